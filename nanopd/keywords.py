"""LLM()'s keywords beyond EngineConfig's fields, checked: vLLM's that change nothing here
(VLLM_KEYWORDS), the cluster's (ClusterConfig's fields: they apply with a policy only), and
an unknown one, named with the nearest keyword LLM takes. llm.py loads this module only for
an LLM given one of them, or a policy: a plain LLM needs none of it.
"""

import dataclasses
import difflib
import functools

# vLLM's LLM keywords that change nothing here: each one's values that nanoPD serves as vLLM
# would, and (for a value it cannot serve) what it lacks.
VLLM_KEYWORDS = {
    "trust_remote_code": ((False, True), "runs no code from a checkpoint: Qwen3 is built in"),
    "disable_log_stats": ((False, True), "logs no stats"),
    "tensor_parallel_size": ((1,), ("has no tensor parallelism: a model runs whole on each device "
                                    "(policy=... with devices=[...] serves on several)")),
    "pipeline_parallel_size": ((1,), "has no pipeline parallelism: a model runs whole on each device"),
    "enable_chunked_prefill": ((True,), "always chunks prefills (max_num_batched_tokens a step)"),
    "quantization": ((None,), "has no quantized weights"),
    "kv_cache_dtype": (("auto",), "keeps the KV cache in the model's dtype"),
}


def cluster_settings(settings: dict, engine: list[str], keywords: list[str], policy: str | None,
                     profile) -> dict:
    """The cluster's settings among LLM()'s (engine: EngineConfig's names; keywords: LLM's
    own), each checked: a vLLM keyword's value nanoPD cannot serve, an unknown name, or a
    cluster setting (or profile) given without a policy is a ValueError naming it."""
    settings = without_vllm_keywords(settings)
    check_settings(settings, engine, keywords)
    cluster = {k: v for k, v in settings.items() if k not in engine}
    if policy is None:
        given = [k for k, v in cluster.items() if v != cluster_defaults()[k]]
        given += ["profile"] if profile is not None else []
        if given:
            raise ValueError(f"{', '.join(given)} only apply with a policy (collocated, disaggregated, "
                             "adaptive); without one, LLM is a single engine on `device`")
    return cluster


def without_vllm_keywords(settings: dict) -> dict:
    """settings less VLLM_KEYWORDS, each checked: a value nanoPD cannot serve is a ValueError
    naming it and what nanoPD lacks."""
    for name, (allowed, lacks) in VLLM_KEYWORDS.items():
        value = settings.get(name, allowed[0])
        if value not in allowed or type(value) not in {type(a) for a in allowed}:   # True is not 1 here
            raise ValueError(f"{name}={value!r}: nanoPD {lacks} (it takes {' or '.join(map(repr, allowed))})")
    return {k: v for k, v in settings.items() if k not in VLLM_KEYWORDS}


@functools.cache
def cluster_defaults() -> dict:
    """Each cluster setting (ClusterConfig's fields) and its default, read only where a
    setting is not the engine's: a plain LLM loads none of the cluster's modules."""
    from nanopd.cluster import ClusterConfig
    return {f.name: f.default for f in dataclasses.fields(ClusterConfig) if f.name != "policy"}


def check_settings(settings: dict, engine: list[str], keywords: list[str]) -> None:
    """A ValueError for a keyword LLM does not take, naming the nearest one it does."""
    for name in settings:
        if name not in engine and name not in cluster_defaults():
            names = engine + list(cluster_defaults()) + keywords
            near = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ValueError(f"LLM() got an unknown setting {name!r}{hint} (the settings are LLM's keywords, "
                             f"ClusterConfig's fields: {', '.join(cluster_defaults())}, and EngineConfig's: "
                             f"{', '.join(engine)})")
