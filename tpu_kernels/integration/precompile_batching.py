"""precompile's warm-up for continuous batching (`generate_batch`): every kernel shape its steps can meet.

Each step of transformers' continuous batching runs the model once over the packed tokens of up to
`max_requests_per_batch` sequences: at most `max_batch_tokens` queries in all, each sequence's keys its cached ones and
its new ones. The kernels see the step's queries at their token bucket (the norms and experts, and attention's query
rows), its keys at their key bucket, the number of sequences at a power of two of at least 16, and the longest
sequence's queries as a token bucket (1 for a step of decodes): attention-tpu's `flash_api.ragged_varlen_attention`.
`batching_steps` lists one step per combination of those a batch can reach; `warm_continuous_batching` runs the
model's forward on each as continuous batching calls it (packed sequences and their cumulative lengths), with a
stand-in for its paged cache that hands each layer the step's keys.

What it cannot warm, nothing can: continuous batching hands the model its packed tokens at their real count (it
pads them only when it compiles the model), so every op at that count, transformers' and the pads of ours
around the kernels alike, is a program per count under TorchTPU's strict eager.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..runtime.buckets import key_bucket, key_buckets, token_bucket, token_buckets

# The fewest sequences the ragged kernel is handed (attention-tpu's padding.RAGGED_SEQUENCES_FLOOR).
SEQUENCES_FLOOR = 16


def _sequences_bucket(count: int) -> int:
    return max(SEQUENCES_FLOOR, 1 << max(count - 1, 0).bit_length())


@dataclass(frozen=True)
class Step:
    """One step's sequences: each one's queries and its keys (its cached ones and its queries, the last of them)."""

    queries: tuple[int, ...]
    keys: tuple[int, ...]

    def kernel_shape(self) -> tuple[int, int, int, int]:
        """(query rows, key rows, sequences, longest queries' bound) as the kernels get them."""
        rows = token_bucket(sum(self.queries))
        longest = max(self.queries)
        return (rows, key_bucket(sum(self.keys)), _sequences_bucket(len(self.queries)),
                1 if longest <= 1 else min(token_bucket(longest), rows))


def _step(total_q: int, sequences: int, longest: int, total_k: int, max_keys: int) -> Step:
    """A step of `sequences` sequences, `total_q` queries (one sequence's `longest`, none longer) and `total_k` keys,
    none more than `max_keys` per sequence (`batching_steps` passes counts that can be so)."""
    others, spread = sequences - 1, total_q - longest
    queries = [longest] + [spread // others + (i < spread % others) for i in range(others)]
    keys, extra = list(queries), total_k - total_q
    for i, held in enumerate(keys):
        added = min(extra, max_keys - held)
        keys[i], extra = held + added, extra - added
    return Step(tuple(queries), tuple(keys))


def _below(ladder: list[int], bucket: int) -> int:
    """The bucket before `bucket` on its ladder (0 for the first): a bucket holds the counts above it up to itself."""
    return max((b for b in ladder if b < bucket), default=0)


def batching_steps(max_batch_tokens: int, max_requests_per_batch: int, max_keys: int,
                   max_total_keys: int) -> list[Step]:
    """One step per kernel shape (`Step.kernel_shape`) a continuous batch can reach: at most `max_batch_tokens`
    queries and `max_requests_per_batch` sequences, each of at most `max_keys` keys, at most `max_total_keys` keys in
    all (the paged cache's).

    For each query bucket, longest-query bound and number of sequences, the fewest queries that reach them (one
    sequence of the longest queries the bound allows, the others sharing the rest, none longer), then every key
    bucket between those queries and the most keys the sequences hold."""
    token_ladder = token_buckets(max_batch_tokens)
    key_ladder = key_buckets(max(min(max_total_keys, max_requests_per_batch * max_keys), 1))
    found: dict[tuple, Step] = {}
    for rows in token_ladder:
        fewest_q, most_q = _below(token_ladder, rows) + 1, min(rows, max_batch_tokens)
        for bound in [1] + [b for b in token_ladder if 1 < b <= rows]:
            if bound == 1:
                shortest, longest_allowed = 1, 1
            elif bound < rows:
                shortest, longest_allowed = max(_below(token_ladder, bound) + 1, 2), bound
            else:
                shortest, longest_allowed = max(fewest_q, 2), most_q
            for sequences in range(1, max_requests_per_batch + 1):
                longest = max(shortest, -(-fewest_q // sequences))
                if longest > min(longest_allowed, most_q - sequences + 1, max_keys):
                    continue
                total_q = max(longest + sequences - 1, fewest_q)
                most_k = min(max_total_keys, sequences * max_keys)
                if total_q > most_k:
                    continue
                for keys_bucket in key_ladder:
                    if key_bucket(total_q) <= keys_bucket and _below(key_ladder, keys_bucket) < most_k:
                        shape = (rows, keys_bucket, _sequences_bucket(sequences), bound)
                        if shape not in found:
                            total_k = max(total_q, _below(key_ladder, keys_bucket) + 1)
                            found[shape] = _step(total_q, sequences, longest, total_k, max_keys)
    return [found[shape] for shape in sorted(found)]


def _stand_in_cache(total_k: int):
    """continuous batching's paged cache as the model sees it during one step: each layer's `update` hands back the
    step's `total_k` keys and values, its new ones last (their values do not matter to a warm-up)."""
    import torch
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    class StandIn(PagedAttentionCache):
        def __init__(self):  # no pages: nothing is read or kept
            pass

        def update(self, key_states, value_states, layer_idx, kwargs):
            def with_cached(states):
                cached = states.new_zeros((*states.shape[:2], total_k - states.shape[2], states.shape[3]))
                return torch.cat([cached, states], dim=2)

            return with_cached(key_states), with_cached(value_states)

    return StandIn()


def _run_step(model, step: Step, device) -> None:
    import torch

    positions = [torch.arange(k - q, k) for q, k in zip(step.queries, step.keys)]
    cumulative = [torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
                  for lengths in (step.queries, step.keys)]
    total_q = sum(step.queries)
    tokens = torch.randint(0, model.config.get_text_config().vocab_size, (1, total_q),
                           generator=torch.Generator().manual_seed(total_q))
    model(input_ids=tokens.to(device), position_ids=torch.cat(positions)[None].to(device),
          cu_seq_lens_q=cumulative[0], cu_seq_lens_k=cumulative[1], max_length_q=max(step.queries),
          max_length_k=max(step.keys), cache=_stand_in_cache(sum(step.keys)), use_cache=False, is_causal=True,
          logits_to_keep=1)


def check_continuous_batching(model, config) -> None:
    """ValueError unless `config` names the batch's bounds and `model` is on a flash implementation."""
    unset = [name for name in ("max_batch_tokens", "max_requests_per_batch")
             if isinstance(getattr(config, name), bool) or not isinstance(getattr(config, name), int)
             or getattr(config, name) < 1]
    if unset:
        raise ValueError(f"continuous_batching must name {' and '.join(unset)} (a whole number of at least 1): "
                         "transformers infers them from the device's free memory at run time, so no warm-up "
                         "can know them")
    if "flash" not in str(model.config._attn_implementation):
        raise ValueError(f"continuous batching runs only on a flash implementation, and this model is on "
                         f"{model.config._attn_implementation!r} (kernelize's report says why)")


def warm_continuous_batching(model, config, max_keys: int, progress: bool = True) -> list[Step]:
    """Run `model` once per step of `batching_steps` for continuous batching as `config` (a ContinuousBatchingConfig)
    bounds it, with requests of at most `max_keys` keys (all of them, if its cache has no `num_blocks`); returns the
    steps run. ValueError as `check_continuous_batching` says."""
    import torch
    from tqdm.auto import tqdm

    check_continuous_batching(model, config)
    requests = config.max_requests_per_batch
    total = config.num_blocks * config.page_size if config.num_blocks else requests * max_keys
    steps = batching_steps(config.max_batch_tokens, requests, max_keys, total)
    device = next(model.parameters()).device
    with torch.no_grad():
        for step in tqdm(steps, desc="precompiling continuous batching", unit="step", disable=not progress):
            _run_step(model, step, device)
    return steps
