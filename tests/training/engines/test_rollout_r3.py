"""R3 end to end: a bf16 MoE rollout server returns its routed experts through the router, and the
fp32 trainer replaying them (``routing="r3"``) uses exactly the rollout's expert choices."""

import numpy as np
import pytest
import torch

from training.engines.client import SyncRolloutClient
from training.engines.embedded.launch import EmbeddedServer, start_all
from training.engines.embedded.trainer import EmbeddedTrainEngine
from training.engines.hf_io import save_hf_dir
from training.engines.model import CausalLM, ModelConfig
from training.engines.rollout import GenerateRequest, SamplingParams
from training.engines.train import TokenBatch
from training.tasks.tokenizer import CharTokenizer

LAYERS, EXPERTS, TOP_K = 2, 4, 2
PROMPTS = ["1+2=", "3+4+5=", "9=", "2+2+2+2+2=", "7+1=", "6+6+6="]


def _moe_checkpoint(path):
    cfg = ModelConfig(vocab_size=CharTokenizer().vocab_size, hidden_size=32, num_layers=LAYERS,
                      num_heads=2, num_kv_heads=2, intermediate_size=48,
                      max_position_embeddings=128, num_experts=EXPERTS, num_experts_per_tok=TOP_K)
    model = CausalLM(cfg).init_weights(0, std=0.15)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a wide router: every expert gets traffic, choices are not ties
        for layer in model.model.layers:
            gate = layer.block_sparse_moe.gate.weight
            gate.copy_(torch.randn(gate.shape, generator=g) * 0.5)
    return save_hf_dir(path, model, CharTokenizer(), weight_version=0)


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory):
    root = tmp_path_factory.mktemp("r3")
    ckpt = _moe_checkpoint(root / "moe")
    server = EmbeddedServer(ckpt, dtype="bf16", max_batch=8, log_path=root / "server.log")
    start_all([server])
    try:
        tok = CharTokenizer()
        reqs = [GenerateRequest([1, *tok.encode(p)],
                                SamplingParams(max_new_tokens=24, ignore_eos=True, seed=i),
                                return_routed_experts=True) for i, p in enumerate(PROMPTS)]
        with SyncRolloutClient([server.url], health_interval_s=0.5) as client:
            results = [r for [r] in client.generate(reqs)]
    finally:
        server.stop()
    return ckpt, results


def test_r3_replay_uses_exactly_the_rollouts_expert_choices(rollouts):
    ckpt, results = rollouts
    for r in results:
        assert r.routed_experts.shape == (r.prompt_tokens + r.completion_tokens - 1, LAYERS, TOP_K)
    served = [torch.from_numpy(r.routed_experts) for r in results]
    assert len(torch.cat(served).unique()) == EXPERTS  # routes spread over every expert
    batch = TokenBatch.from_sequences([r.prompt_ids for r in results],
                                      [r.output_ids for r in results],
                                      routes=[r.routed_experts for r in results])
    trainer = EmbeddedTrainEngine.from_pretrained(ckpt)
    r3 = trainer.compute_log_probs(batch, routing="r3")
    free = trainer.compute_log_probs(batch, routing="free")
    flipped = 0
    for i, rollout_routes in enumerate(served):
        used = r3.routes[i]
        assert used.dtype == torch.int32 and torch.equal(used, rollout_routes), (
            f"sequence {i}: the trainer's R3 forward used other experts than the rollout")
        n = results[i].completion_tokens
        # free routing is NOT required to match: the fp32 trainer may pick another expert set
        # than the bf16 rollout where two gate scores nearly tie (a top-k order swap is no flip)
        same_set = torch.equal(free.routes[i].sort(-1).values, rollout_routes.sort(-1).values)
        gap = (r3.log_probs[i, :n] - free.log_probs[i, :n]).abs().max().item()
        if same_set:  # replaying the experts free routing chose anyway changes nothing
            assert gap < 1e-5, f"sequence {i}: same experts, log-probs moved by {gap}"
        else:  # the replay took effect: other experts, other log-probs
            flipped += 1
            assert gap > 1e-4, f"sequence {i}: other experts replayed, log-probs moved {gap}"
    # R3 log-probs are the rollout's computation redone in fp32: close to the served bf16 ones
    served_lp = torch.tensor([lp for r in results for lp in r.output_logprobs])
    r3_lp = torch.cat([r3.log_probs[i, :r.completion_tokens] for i, r in enumerate(results)])
    gap = (served_lp - r3_lp).abs()
    print(f"sequences whose free routing picks other experts than the rollout: {flipped}; "
          f"|served - r3| mean {gap.mean():.4f} max {gap.max():.4f}")
    assert np.isfinite(gap.max().item()) and gap.mean().item() < 0.05
