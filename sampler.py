"""Sampling on the device: from a step's logits to its tokens, their logprobs and beam
search's candidates. The model runner (runner.py) calls these; nothing here waits for
the device, so the host can run ahead while the GPU samples.
"""

from collections.abc import Callable

import torch

from request import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           upload: Callable[[list, torch.dtype], torch.Tensor] | None = None) -> torch.Tensor:
    """One token per row of logits [R, vocab]. Greedy rows take the argmax; the others draw
    from softmax(logits / T) restricted by top-k and top-p, through the exponential race
    argmax(p / E), E ~ Exp(1): seeded rows draw E from their own generator, so their tokens
    do not depend on the other rows. upload puts host lists on the logits' device
    (ModelRunner.upload, which never waits for the device)."""
    upload = upload or (lambda data, dtype: torch.tensor(data, dtype=dtype, device=logits.device))
    greedy = logits.argmax(-1)
    rows = [i for i, p in enumerate(params) if p.temperature > 0]
    if not rows:
        return greedy
    top_k = [params[i].top_k if params[i].top_k > 0 else logits.shape[1] for i in rows]
    top_p = [params[i].top_p for i in rows]
    knobs = upload([[params[i].temperature, top_p[j], top_k[j]] for j, i in enumerate(rows)], torch.float32)
    row_ids = upload(rows, torch.int64)
    x = logits[row_ids].float() / knobs[:, :1]
    if min(top_k) < x.shape[1] or min(top_p) < 1.0:
        x = apply_top_k_top_p(x, knobs[:, 2], knobs[:, 1])
    noise = torch.empty_like(x).exponential_()
    for j, i in enumerate(rows):
        if generators[i] is not None:
            noise[j].exponential_(generator=generators[i])
    greedy[row_ids] = (x.softmax(-1) / noise).argmax(-1)
    return greedy


def apply_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf the logits outside each row's top_k, then outside the smallest set whose
    probability reaches top_p (the most likely token always stays)."""
    sorted_x, order = x.sort(-1, descending=True)
    rank = torch.arange(x.shape[1], device=x.device)
    sorted_x.masked_fill_(rank[None] >= top_k[:, None], float("-inf"))
    probs = sorted_x.softmax(-1)
    sorted_x.masked_fill_(probs.cumsum(-1) - probs > top_p[:, None], float("-inf"))
    return torch.full_like(x, float("-inf")).scatter_(-1, order, sorted_x)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Of the model's distribution (before temperature, top-k and top-p, as vLLM reports
    them): each row's chosen token's logprob [R], and its k most likely tokens' logprobs
    and ids [R, k]."""
    lp = torch.log_softmax(logits.float(), -1)
    top = lp.topk(max(1, k), -1)
    return lp.gather(1, tokens[:, None])[:, 0], top.values, top.indices


def beam_candidates(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Beam search's candidate continuations of each row: the k most likely tokens' logprobs
    and ids [R, k]."""
    top = torch.log_softmax(logits.float(), -1).topk(k, -1)
    return top.values, top.indices
