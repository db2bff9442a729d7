"""The regime as one map: each worker's role, which every policy writes and dispatch reads.

    role     takes prompts  takes handoffs  its prompts decode     its device
    both     yes            yes             here (or where routed)  whole
    prefill  yes            no              elsewhere: KV moves     whole
    decode   no             yes             -                       whole
    split    yes            yes             here (or where routed)  two SM partitions, prefill / decode

collocated writes every worker both; disaggregated the first num_prefill prefill and the
rest decode, for good (on one device, one split worker on its fixed split); adaptive what
its planner decides (planner.py: both, prefill or decode), as it decides it.
The central scheduler (cluster.py) sends a prompt only to a worker whose role takes
prompts, a prefilled request only to one whose role takes handoffs, and tells a worker its
part of the regime (messages.py:SetRole) whenever that part changes. A new role is a new
row of ROLES: dispatch reads the row, never the role's name.
"""

from dataclasses import dataclass

from nanopd.messages import SetRole


@dataclass(frozen=True)
class Role:
    """What a role lets dispatch do with a worker."""
    takes_prompts: bool       # new requests are sent here to prefill
    takes_handoffs: bool      # requests prefilled elsewhere are sent here to decode
    hands_off: bool           # what it prefills decodes elsewhere (else here, unless routed elsewhere)
    splits_sms: bool = False  # its prefills and decodes run on SM partitions of its own (SetRole.sm_split)

    @property
    def decodes(self) -> bool:
        """Whether any request decodes here: handed to it, or kept from its own prefill."""
        return self.takes_handoffs or not self.hands_off


ROLES = {
    "both": Role(takes_prompts=True, takes_handoffs=True, hands_off=False),
    "prefill": Role(takes_prompts=True, takes_handoffs=False, hands_off=True),
    "decode": Role(takes_prompts=False, takes_handoffs=True, hands_off=False),
    "split": Role(takes_prompts=True, takes_handoffs=True, hands_off=False, splits_sms=True),
}


def check_role(part: SetRole) -> SetRole:
    """part, or a ValueError if its role is unknown or its SM split does not fit the role."""
    if part.role not in ROLES:
        raise ValueError(f"role {part.role!r} is not one of {', '.join(ROLES)}")
    if ROLES[part.role].splits_sms != (part.sm_split is not None):
        raise ValueError(f"role {part.role!r} takes {'an' if ROLES[part.role].splits_sms else 'no'} SM "
                         f"split, got {part.sm_split}")
    return part


class RoleMap:
    """Worker -> its part of the regime (a SetRole: the role, and a split worker's SM split,
    fixed at start-up). Written by the policy, read by dispatch."""

    def __init__(self, roles: list[str], splits: dict[int, tuple[int, int]] | None = None):
        splits = splits or {}
        self.parts: dict[int, SetRole] = {w: check_role(SetRole(r, splits.get(w)))
                                          for w, r in enumerate(roles)}

    def write(self, roles: dict[int, str]) -> None:
        """The workers named in roles take these roles (unsplit: a split is fixed at
        start-up); the others keep theirs."""
        self.parts |= {w: check_role(SetRole(role)) for w, role in roles.items()}

    def name(self, w: int) -> str:
        return self.parts[w].role

    def role(self, w: int) -> Role:
        return ROLES[self.parts[w].role]

    def takers(self, workers: list[int]) -> list[int]:
        """Those of workers whose role takes prompts."""
        return [w for w in workers if self.role(w).takes_prompts]

    def decoders(self, workers: list[int]) -> list[int]:
        """Those of workers whose role takes handoffs."""
        return [w for w in workers if self.role(w).takes_handoffs]

    def names(self) -> dict[int, str]:
        return {w: part.role for w, part in self.parts.items()}
