"""The Gemma 4 assistant (transformers' gemma4_assistant) as a proposer beside a tiny random Gemma 4
target: its draft equals transformers' assistant's on the same inputs (logits within fp32
tolerance, reading the target's paged cache, sliding window included), and greedy speculative
decoding with it gives the target's own greedy tokens and transformers' assisted generation's,
on 5 prompts past the window. Through the engine (`proposer: assistant`, the assistant's folder
in the draft model slot): the same tokens as without it, drafts kept; and the proposer refused,
by name, where there is no assistant or no Gemma 4 target."""
import pytest
import torch

from engine import EngineConfig, SamplingParams
from engine.engine import LLMEngine
from engine.errors import ConfigError, UnsupportedModelError
from engine.loading.loader import load_model
from engine.models.gemma4_assistant import load_assistant
from engine.runtime.model_runner import ModelRunner
from engine.speculative.assistant_proposer import AssistantProposer
from tests.test_gemma4 import ROPE, _gemma4, _save

GREEDY = SamplingParams(max_tokens=12, stop_on_eos=False)


def _assistant_config(**extra):
    from transformers.models.gemma4_assistant import Gemma4AssistantConfig
    text = dict(model_type="gemma4_text", vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=4,
                layer_types=["sliding_attention", "full_attention"], rope_parameters=ROPE, num_kv_shared_layers=2,
                hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, max_position_embeddings=128)
    return Gemma4AssistantConfig(text_config=text, **{"backbone_hidden_size": 64, **extra})


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(our target runner's LoadedModel, our assistant, transformers' target, transformers' assistant)."""
    from transformers.models.gemma4_assistant import Gemma4AssistantForCausalLM
    folder = tmp_path_factory.mktemp("gemma4-pair")
    ref = _save(folder / "target", lambda: _gemma4())
    torch.manual_seed(1)
    assistant = Gemma4AssistantForCausalLM(_assistant_config()).eval()
    with torch.no_grad():
        for name, p in assistant.named_parameters():
            p.add_(torch.randn_like(p) * 0.1) if "norm" in name else p.mul_(4.0)
    assistant.generation_config.num_assistant_tokens = 3      # a shipped assistant's generation_config.json has it
    assistant.save_pretrained(folder / "assistant")
    loaded = load_model(str(folder / "target"))
    return loaded, load_assistant(folder / "assistant", loaded.model), ref, assistant


def test_a_draft_is_transformers_assistants(pair):
    """After a 10-token prefill (past the 4-token window): the first draft's logits and the
    hidden state it hands on, from the target's pool, as transformers' assistant gives them
    from the target's shared_kv_states."""
    loaded, ours, ref, theirs = pair
    prompt = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = ref(prompt, return_shared_kv_states=True, output_hidden_states=True)
        token = out.logits[0, -1].argmax().view(1, 1)
        rows = torch.cat([ref.get_input_embeddings()(token), out.hidden_states[-1][:, -1:]], -1)
        expected = theirs(inputs_embeds=rows, position_ids=torch.tensor([[10]]), shared_kv_states=out.shared_kv_states)
    runner = ModelRunner(loaded, EngineConfig(block_size=4, num_blocks=32, compile="off"), torch.device("cpu"))
    seq = runner.start(prompt[0].tolist())
    runner.forward(seq, prompt[0].tolist())
    proposer = AssistantProposer(ours, runner)
    proposer.follow(seq)
    proposer.target_pass(0, runner.last_hidden)
    rows = loaded.model.embed_tokens(token[0])[:, :64]
    logits, hidden = ours.draft(rows, runner.last_hidden[-1:], torch.tensor([10]), runner.kv, proposer._meta(10))
    assert (logits - expected.logits[0]).abs().max() < 1e-4
    assert (hidden - expected.last_hidden_state[0]).abs().max() < 1e-4
    assert len(proposer.propose(prompt[0].tolist() + [int(token)], 3, GREEDY, None).tokens) == 3


def _speculate(runner, proposer, prompt: list[int], new_tokens: int, k: int) -> tuple[list[int], int]:
    """Greedy speculative decoding over one sequence (the engine's verify, as a loop): the target
    feeds the last token and the drafts in one pass and keeps the drafts equal to its argmax,
    then its own next token. Returns (the new tokens, drafts accepted)."""
    seq = runner.start(prompt)
    proposer.follow(seq)
    logits = runner.forward(seq, prompt)
    proposer.target_pass(0, runner.last_hidden)
    tokens, accepted = list(prompt) + [int(logits[-1].argmax())], 0
    while len(tokens) - len(prompt) < new_tokens:
        drafts = proposer.propose(tokens, k, GREEDY, None).tokens
        start = seq.num_computed
        logits = runner.forward(seq, [tokens[-1]] + drafts, logits_for=len(drafts) + 1)
        proposer.target_pass(start, runner.last_hidden)
        kept = 0
        while kept < len(drafts) and drafts[kept] == int(logits[kept].argmax()):
            kept += 1
        runner.rollback(seq, len(tokens) + kept)
        tokens += drafts[:kept] + [int(logits[kept].argmax())]
        accepted += kept
    runner.end(seq)
    return tokens[len(prompt):len(prompt) + new_tokens], accepted


@pytest.fixture(scope="module")
def echo_pair(echo_folder, pair):
    folder, theirs = echo_folder
    return pair[0], load_assistant(folder, pair[0].model), pair[2], theirs


@pytest.fixture(scope="module")
def echo_folder(tmp_path_factory, pair):
    """(Its folder, transformers' model:) the target with an assistant that drafts what the target last predicted, again and again
    (it passes the target's hidden state through: pre_projection picks it, attention and MLP add
    nothing, the head is the target's): a random assistant agrees with a random target too
    rarely for a test to see drafts kept, and this one is right wherever the target repeats."""
    from transformers.models.gemma4_assistant import Gemma4AssistantForCausalLM
    _, _, ref, _ = pair
    folder = tmp_path_factory.mktemp("gemma4-echo")
    config = _assistant_config()
    config.text_config.hidden_size = 64
    theirs = Gemma4AssistantForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn_like(p))
        theirs.pre_projection.weight.copy_(torch.cat([torch.zeros(64, 64), torch.eye(64)], dim=1))
        theirs.post_projection.weight.copy_(torch.eye(64))
        theirs.model.embed_tokens.weight.copy_(ref.model.embed_tokens.weight)
        for layer in theirs.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    theirs.generation_config.num_assistant_tokens = 3
    theirs.save_pretrained(folder)
    return folder, theirs


def test_greedy_output_is_the_targets_with_and_without_the_assistant(echo_pair):
    loaded, ours, ref, theirs = echo_pair
    runner = ModelRunner(loaded, EngineConfig(block_size=4, num_blocks=64, compile="off"), torch.device("cpu"))
    proposer = AssistantProposer(ours, runner)
    rng = torch.Generator().manual_seed(11)
    total = 0
    for n in (3, 6, 9, 14, 21):                  # past the 4-token window
        prompt = torch.randint(0, 128, (n,), generator=rng).tolist()
        drafted, accepted = _speculate(runner, proposer, prompt, 12, k=3)
        total += accepted
        with torch.no_grad():
            plain = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, n:].tolist()
            assisted = ref.generate(torch.tensor([prompt]), assistant_model=theirs, max_new_tokens=12, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0, n:].tolist()
        assert drafted == plain == assisted, f"prompt of {n} tokens"
    assert total >= 3                            # drafts were kept: the accepting path was taken


def test_an_assistant_for_another_target_is_refused(pair):
    from engine.models.gemma4_assistant import Gemma4Assistant
    loaded = pair[0]
    with pytest.raises(UnsupportedModelError, match="hidden size 48"):
        Gemma4Assistant(_assistant_config(backbone_hidden_size=48), loaded.model)


def test_the_engine_drafts_with_the_assistant_and_gives_the_same_tokens(pair, echo_folder):
    """`proposer: assistant` with the assistant's folder as draft_model, through LLMEngine (the
    request's proposer, its verify and rollback): the tokens of the same engine without it, on
    5 prompts past the window, with drafts kept; `proposer: draft` with the assistant in the
    slot drafts with it too, and `auto` counts it among its candidates."""
    loaded = pair[0]
    eng = LLMEngine(loaded, EngineConfig(kv_cache_bytes=2**20, compile="off", speculation_policy="fixed",
                                         num_speculative_tokens=3), torch.device("cpu"))
    rng = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 128, (n,), generator=rng).tolist() for n in (3, 6, 9, 14, 21)]
    plain = [eng.generate_text(p, GREEDY)[1] for p in prompts]
    eng.reconfigure(proposer="assistant", draft_model=str(echo_folder[0]))
    assert eng.settings()["proposer"] == "assistant" and eng.draft_runner is None      # no pool of its own
    drafted = [eng.generate_text(p, GREEDY) for p in prompts]
    assert [ids for _, ids, _ in drafted] == plain
    assert sum(stats.accepted for _, _, stats in drafted) >= 3
    eng.reconfigure(proposer="draft")
    assert eng.speculator.proposer_in_effect() == "assistant"
    assert eng.generate_text(prompts[0], GREEDY)[1] == plain[0]
    eng.reconfigure(proposer="auto")                 # a candidate of auto's, measured first in its turn
    assert "assistant" in eng.speculator.auto_candidates()
    assert [eng.generate_text(p, GREEDY)[1] for p in prompts] == plain
    assert eng.speculator.proposer_choice.total["assistant"].proposed > 0


def test_the_assistant_proposer_is_refused_without_an_assistant_or_a_gemma4_target(pair, echo_folder, tiny_model):
    gemma4 = LLMEngine(pair[0], EngineConfig(kv_cache_bytes=2**20, compile="off"), torch.device("cpu"))
    with pytest.raises(ConfigError, match="set draft_model to its folder"):
        gemma4.reconfigure(proposer="assistant")
    assert gemma4.config.proposer == "off"
    llama = LLMEngine(tiny_model, EngineConfig(kv_cache_bytes=2**20, compile="off"), torch.device("cpu"))
    with pytest.raises(ConfigError, match="this model is 'llama'"):
        llama.reconfigure(proposer="assistant", draft_model=str(echo_folder[0]))
    with pytest.raises(UnsupportedModelError, match="not 'llama'"):
        llama.reconfigure(draft_model=str(echo_folder[0]))      # the slot checks the pair as it loads
    assert llama.draft_name is None
