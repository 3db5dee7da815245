"""k chosen by the wall (core/spec_k_policy.py) against the roofline's own pricing of a step:
drafts stay at their full length where a step is weight-read bound and drafts are accepted, fall
with the acceptance, and fall to 0 where the batch is compute-bound."""

from __future__ import annotations

from stoker.core.spec_k_policy import HALF_LIFE, PlannedSeq, SpecKPolicy
from stoker.roofline.efficiency import Efficiencies
from stoker.roofline.gpu_spec import LINKS, GPUSpec
from stoker.roofline.live import WallModel
from stoker.roofline.modelspec import spec_from_config

# A ~150M-parameter Llama shape, float32 weights, on a host whose roofs are 0.15 TFLOP/s and
# 12 GB/s (the balance of a 2-core VM: ~12 FLOP per byte). A decode token costs 2 FLOPs per
# weight (4 bytes): a step is compute-bound above ~24 tokens.
CONFIG = {"model_type": "llama", "hidden_size": 768, "num_attention_heads": 12, "num_key_value_heads": 12,
          "intermediate_size": 2048, "num_hidden_layers": 12, "vocab_size": 32000, "max_position_embeddings": 2048}
HOST = GPUSpec("host", 0.15, None, None, 16, 12.0, LINKS["none"], "test", fp32_tflops=0.15)


def _price():
    wall = WallModel(spec_from_config(CONFIG), HOST, Efficiencies.ideal(), weight_dtype="fp32", kv_dtype="fp32",
                     act_dtype="fp32")
    return lambda shape: wall.judge(shape, 0.0).predicted_s


def _trained(acceptance: float, k: int = 4, n: int = 2000) -> SpecKPolicy:
    """A policy that saw `n` verifications of k drafts each accepting with probability `acceptance`
    at every position (the accepted run's length: a deterministic mix with those odds)."""
    policy = SpecKPolicy(k, _price())
    for i in range(n):
        accepted = 0
        while accepted < k and ((i * 7919 + accepted * 104729) % 1000) / 1000 < acceptance:
            accepted += 1
        policy.observe(k, accepted)
    return policy


def _batch(b: int, drafts: int = 4, context: int = 256) -> list[PlannedSeq]:
    return [PlannedSeq(context, drafts) for _ in range(b)]


def test_memory_bound_with_high_acceptance_keeps_the_full_k() -> None:
    policy = _trained(0.9)
    assert 0.85 < policy.acceptance()[0] < 0.95
    assert policy.choose(_batch(1)) == 4
    assert policy.choose(_batch(2)) == 4


def test_compute_bound_batch_drafts_nothing() -> None:
    # Short contexts: the KV read is small, 32+ sequences' tokens make the step compute-bound
    policy = _trained(0.9)
    assert policy.choose(_batch(64, context=16)) == 0
    assert policy.choose(_batch(256, context=16)) == 0
    assert policy.steps_at_k[0] == 2 and policy.last_k == 0
    # Long contexts at the same batch: the step is bound by reading the KV cache, which a verify
    # step reads once for 1 + k tokens: drafting pays again (the cost model says so; so does the policy)
    assert policy.choose(_batch(64, context=256)) > 0


def test_k_falls_with_the_batch_and_with_acceptance() -> None:
    high, low = _trained(0.9), _trained(0.15)
    ks_high = [high.choose(_batch(b, context=16)) for b in (1, 4, 8, 16, 32, 64)]
    assert ks_high == sorted(ks_high, reverse=True) and ks_high[:2] == [4, 4] and ks_high[-1] == 0
    ks_low = [low.choose(_batch(b, context=16)) for b in (1, 4, 8, 16, 32, 64)]
    assert all(a <= b for a, b in zip(ks_low, ks_high)) and ks_low[0] < 4
    assert low.choose(_batch(4, context=16)) < high.choose(_batch(4, context=16))


def test_no_cost_model_keeps_k_and_no_proposal_is_k_zero() -> None:
    fixed = SpecKPolicy(3, None)
    assert fixed.choose(_batch(64, drafts=5)) == 3 and fixed.choose(_batch(64, drafts=2)) == 2
    assert fixed.choose(_batch(4, drafts=0)) == 0
    assert fixed.steps_at_k == {3: 1, 2: 1}  # steps with proposals only


def test_acceptance_is_learned_per_position_and_forgets() -> None:
    policy = SpecKPolicy(3, None)
    assert policy.acceptance() == [0.5, 0.5, 0.5]  # the prior
    for _ in range(200):
        policy.observe(3, 1)  # the first draft always kept, the second always rejected
    a = policy.acceptance()
    assert a[0] > 0.98 and a[1] < 0.02 and a[2] == 0.5  # position 2 never reached: still the prior
    assert abs(policy.expected_accepted(3) - (a[0] + a[0] * a[1] + a[0] * a[1] * a[2])) < 1e-12
    for _ in range(3000):
        policy.observe(3, 3)
    assert min(policy.acceptance()) > 0.9


def test_a_verify_chunk_is_priced_as_a_decode_plus_its_drafts() -> None:
    shape = SpecKPolicy.shape([PlannedSeq(10, 3), PlannedSeq(20, 0)], cap=2)
    # both read their context once (10 + 20 positions); seq 0 computes 2 more tokens attending
    # 11 and 12 positions (the known token at position 9 attends 10, priced with the decode)
    assert (shape.num_prefill_tokens, shape.prefill_attended, shape.num_decode_seqs, shape.decode_context,
            shape.num_sampled, shape.num_draft_tokens, shape.draft_attended) == (0, 0, 2, 30, 4, 2, 23)
    assert shape.kind == "decode"
    price = _price()
    decode = price(SpecKPolicy.shape(_batch(64), 0))
    assert price(SpecKPolicy.shape(_batch(64), 1)) > decode  # verifying more is never cheaper


def test_drafts_almost_never_accepted_are_not_verified_even_where_they_look_free() -> None:
    """At batch 1 the roofline prices 3 extra tokens at nearly nothing (the weight read bounds
    the step), so an acceptance of ~0.5% would still look like a gain; it is within the model's
    error (each verified row still costs its attention, LM head row and sampling), so k falls to
    0 (it stayed 3 before MIN_GAIN), while a real acceptance keeps drafting there."""
    never = _trained(0.0, n=300)
    assert never.choose(_batch(1, context=16)) == 0 and never.choose(_batch(4, context=16)) == 0
    assert _trained(0.3, n=300).choose(_batch(1, context=16)) > 0
    # drafting nothing learns nothing: the steps that proposed age the estimate, and drafting is
    # tried again after a few half-lives (a workload whose drafts now pass is noticed)
    ks = [never.choose(_batch(1, context=16)) for _ in range(int(6 * HALF_LIFE))]
    first = next(i for i, k in enumerate(ks) if k > 0)
    assert HALF_LIFE < first < 6 * HALF_LIFE


def _draft_price(**config):
    """The roofline's price of one forward of a draft of `config`'s shape (CONFIG's otherwise)."""
    wall = WallModel(spec_from_config({**CONFIG, **config}), HOST, Efficiencies.ideal(), weight_dtype="fp32",
                     kv_dtype="fp32", act_dtype="fp32")
    return lambda shape: wall.judge(shape, 0.0).predicted_s


def _trained_with_draft(draft_price, acceptance: float = 0.9, k: int = 4) -> SpecKPolicy:
    policy = SpecKPolicy(k, _price(), draft_price)
    learned = _trained(acceptance, k)
    policy._reached, policy._accepted = learned._reached, learned._accepted
    return policy


def test_a_draft_models_forwards_are_priced() -> None:
    """Each proposal round is a draft forward over the batch: a draft as large as the target costs
    about a decode per drafted token, more than the accepted tokens save even at acceptance 0.9,
    so k = 0 (no draft forward); a draft ~1/20 the size keeps the full k where the target's step is
    weight-read bound, and the draft's cost lowers k before the compute-bound batch does."""
    same_size = _trained_with_draft(_price())
    assert same_size.choose(_batch(1)) == 0 and same_size.choose(_batch(4)) == 0
    small = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 512,
             "num_hidden_layers": 2, "vocab_size": 4000}
    assert _trained_with_draft(_draft_price(**small)).choose(_batch(1)) == 4
    # a third of the target's layers and its whole LM head: about half its weight read per round
    medium = _trained_with_draft(_draft_price(num_hidden_layers=4))
    free = _trained(0.9)  # the same acceptance with drafts priced at nothing (n-gram)
    ks_medium = [medium.choose(_batch(b)) for b in (1, 4, 8, 16, 32)]
    ks_free = [free.choose(_batch(b)) for b in (1, 4, 8, 16, 32)]
    assert ks_free == [4, 4, 3, 3, 3] and ks_medium == [3, 3, 2, 1, 0]
    # the round's shape: a decode of the sequences that propose, over their contexts
    shape = SpecKPolicy.draft_shape([PlannedSeq(10, 3), PlannedSeq(20, 0), PlannedSeq(30, 1)])
    assert (shape.num_decode_seqs, shape.decode_context, shape.num_sampled, shape.num_prefill_tokens) == (2, 40, 2, 0)


def test_an_eagle3_head_is_priced_as_its_one_layer_and_draft_vocabulary(tmp_path) -> None:
    import json

    from stoker.engine.spec_k import draft_config

    head = {**CONFIG, "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1, "draft_vocab_size": 2000,
            "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(head))
    cfg = draft_config("eagle3", str(tmp_path))
    assert (cfg["vocab_size"], cfg["num_hidden_layers"], cfg["tie_word_embeddings"]) == (2000, 1, False)
    (tmp_path / "config.json").write_text(json.dumps({**head, "architectures": ["LlamaForCausalLM"]}))
    assert draft_config("draft_model", str(tmp_path))["vocab_size"] == CONFIG["vocab_size"]
