import pytest
import torch

from training.engines.evaluate import evaluate, generate
from training.engines.model import CausalLM, ModelConfig
from training.tasks.sum_digits import SumDigitsTask
from training.tasks.tokenizer import CharTokenizer

TOK = CharTokenizer()
CANDIDATES = [TOK.eos_token_id, *TOK.encode("0123,")]


@pytest.fixture(scope="module")
def model():
    """A random tiny model whose head can only prefer <eos>, digits 0-3 and ',' so that responses
    stop at varied lengths (the other rows are zero: their logit is 0)."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=TOK.vocab_size, hidden_size=32, num_layers=2, num_heads=2,
                      num_kv_heads=2, intermediate_size=64, max_position_embeddings=64)
    m = CausalLM(cfg).init_weights(seed=1, std=0.3)
    with torch.no_grad():
        keep = m.lm_head.weight[CANDIDATES].clone()
        m.lm_head.weight.zero_()
        m.lm_head.weight[CANDIDATES] = keep * 3
    return m.eval()


def naive_greedy(model, prompt, max_new_tokens):
    """Reference: full forward (no cache, no padding) at every step."""
    ids = list(prompt)
    out = []
    for _ in range(max_new_tokens):
        logits, _ = model(torch.tensor([ids]))
        tok = int(logits[0, -1].argmax())
        if tok == TOK.eos_token_id:
            return out, "stop"
        out.append(tok)
        ids.append(tok)
    return out, "length"


def test_batched_cached_greedy_equals_naive_decoding(model):
    task = SumDigitsTask()
    prompts = [TOK.encode(ex.prompt, add_bos=True) for ex in task.examples("eval", 12)]
    gens = generate(model, prompts, max_new_tokens=12, eos_token_id=TOK.eos_token_id)
    reasons = set()
    for prompt, gen in zip(prompts, gens, strict=True):
        tokens, reason = naive_greedy(model, prompt, 12)
        assert gen.tokens == tokens and gen.finish_reason == reason
        reasons.add(reason)
    assert reasons == {"stop", "length"}  # rows left the batch at different steps
    assert any(0 < len(g.tokens) < 12 for g in gens)


def test_sampling_is_seeded(model):
    prompts = [TOK.encode("1+2=", add_bos=True)] * 8
    def sample(seed):
        g = torch.Generator().manual_seed(seed)
        return [x.tokens for x in generate(model, prompts, max_new_tokens=8, temperature=1.0,
                                           eos_token_id=TOK.eos_token_id, generator=g)]
    assert sample(0) == sample(0) != sample(1)


def test_evaluate_counts_buckets_and_does_not_depend_on_batch_size(model):
    task = SumDigitsTask(min_k=1, max_k=4)
    small = evaluate(model, TOK, task, "eval", 40, batch_size=3)
    big = evaluate(model, TOK, task, "eval", 40, batch_size=64)
    assert [s[1] for s in small.samples] == [s[1] for s in big.samples]
    assert {d: b.n for d, b in big.per_difficulty.items()} == {1: 2, 2: 10, 3: 10, 4: 10}
    rewards = [task.reward(ex, text) for ex, text, _ in big.samples]
    assert [r for *_, r in big.samples] == rewards
    assert big.accuracy == pytest.approx(sum(rewards) / len(rewards))
    table = big.table()
    assert [row["difficulty"] for row in table] == [1, 2, 3, 4, "all"]
    assert table[-1]["n"] == 32 and 0.0 <= table[-1]["truncated_fraction"] <= 1.0
    assert model.training is False


def test_evaluate_rejects_an_empty_split(model, tmp_path):
    with pytest.raises(ValueError, match="no eval examples"):
        evaluate(model, TOK, SumDigitsTask(), "eval", 0)
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, [[]], max_new_tokens=2, eos_token_id=2)


@pytest.fixture(scope="module")
def call_model():
    """A random tiny model whose head prefers digits, '+', ']' and <eos>, so that its samples
    are full of (mostly malformed, some valid) calculator calls."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=TOK.vocab_size, hidden_size=32, num_layers=2, num_heads=2,
                      num_kv_heads=2, intermediate_size=64, max_position_embeddings=128)
    m = CausalLM(cfg).init_weights(seed=2, std=0.3)
    favoured = [TOK.eos_token_id, *TOK.encode("12+[]")]
    with torch.no_grad():
        keep = m.lm_head.weight[favoured].clone()
        m.lm_head.weight.zero_()
        m.lm_head.weight[favoured] = keep
    return m.eval()


def test_tool_trajectories_run_the_agent_loop(call_model):
    """Every turn that ends in ']' is followed by exactly the observation the tool gives for it,
    the trajectory stays within its token and turn limits, and the last turn decides the finish."""
    from training.engines.evaluate import generate_trajectories
    from training.tasks.tools import CalcChainTask

    task = CalcChainTask()
    prompts = [TOK.encode(ex.prompt, add_bos=True) for ex in task.examples("eval", 24)]
    gens = generate_trajectories(call_model, TOK, task, prompts, max_new_tokens=40, max_turns=3,
                                 temperature=1.0, generator=torch.Generator().manual_seed(0))
    close = TOK.encode("]")[0]
    calls = 0
    for gen in gens:
        assert len(gen.tokens) <= 40
        text, turns, rest = TOK.decode(gen.tokens), 1, TOK.decode(gen.tokens)
        while "]" in rest:
            call, rest = rest.split("]", 1)
            want = task.observe(call + "]", 2.0).observation
            if not rest:  # the trajectory ended on a call: no turn or no token left
                assert gen.finish_reason == "length"
                break
            assert want.startswith(rest[:len(want)]) and (rest.startswith(want) or
                                                          len(text) == 40)
            rest = rest[len(want):]
            calls += 1
            turns += 1
        assert turns <= 3
        if gen.finish_reason == "stop":
            assert not gen.tokens or gen.tokens[-1] != close
    assert calls > 0
