"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers' own GGUF
loader: greedy generations, tokenization, chat template and streaming detokenization.

transformers dequantizes the same Q4_1 blocks to float32, so greedy decoding must agree token for
token; its GGUF tokenizer is rebuilt from the same vocab and merges.
"""

from __future__ import annotations

import pytest
import torch

from tinyllm_cli.cache.attention import NoCacheAttention
from tinyllm_cli.model.checkpoint import default_model_path

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

NEW_TOKENS = 20
SPECIAL_IDS = {"<|im_start|>": 1, "<|im_end|>": 2}


@pytest.fixture(scope="module")
def gguf_path():
    return default_model_path()


@pytest.fixture(scope="module")
def gguf_parsed_once():
    """transformers' GGUF loading, minus its repeated work: it parses the file's header anew for
    the config, the weights and the tokenizer, and rebuilds gguf's tensor-name table once per
    submodule (about 400 times); together most of a minute. Both are pure functions of their
    arguments (a read-only memory map; a table of names), so for this module each is built once.
    What transformers computes from them (config, dequantized weights, tokenizer) is its own."""
    import functools

    gguf = pytest.importorskip("gguf")
    readers: dict = {}
    real_reader = gguf.GGUFReader

    def reader(path, *args, **kw):
        key = (str(path), args, tuple(sorted(kw.items())))
        if key not in readers:
            readers[key] = real_reader(path, *args, **kw)
        return readers[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", reader)
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
        yield


@pytest.fixture(scope="module")
def hf_model(gguf_path, gguf_parsed_once):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tok(gguf_path, gguf_parsed_once):
    return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def hf_tok_digits(hf_tok):
    """transformers' GGUF tokenizer with the pre-tokenizer SmolLM2 actually uses.

    SmolLM2's tokenizer.json (and llama.cpp's "smollm" pre-tokenizer type) first isolate every
    digit, then apply the GPT-2 byte-level regex. transformers' GGUF converter ignores that for
    pre type "smollm" and uses plain ByteLevel. We follow the model's own tokenizer, so text with
    digits is compared against transformers' tokenizer with that pre-tokenizer put back.
    """
    from tokenizers.pre_tokenizers import ByteLevel, Digits, Sequence

    tok = tokenizers.Tokenizer.from_str(hf_tok.backend_tokenizer.to_str())  # a copy
    tok.pre_tokenizer = Sequence([Digits(individual_digits=True),
                                  ByteLevel(add_prefix_space=False, use_regex=True)])
    return tok


@pytest.fixture(scope="module")
def tok(default_checkpoint):
    assert default_checkpoint.tokenizer is not None
    return default_checkpoint.tokenizer


# ---- greedy generation -------------------------------------------------------------------

@torch.no_grad()
def _ours_greedy(model, prompt: list[int], n: int, eos: set[int]) -> list[int]:
    ids = list(prompt)
    for _ in range(n):  # no cache: recompute the whole sequence, argmax of the last row
        last = torch.tensor([len(ids) - 1])
        logits = model(torch.tensor(ids), torch.arange(len(ids)), NoCacheAttention([len(ids)]), last)
        ids.append(int(logits[0].argmax()))
        if ids[-1] in eos:
            break
    return ids[len(prompt):]


@torch.no_grad()
def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    x = torch.tensor([prompt])
    out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n)
    return out[0, len(prompt):].tolist()  # stops after transformers' own eos, which it keeps


CHAT_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Name three colours."]


@pytest.fixture(scope="module")
def hf_greedy(hf_model, tok):
    """transformers' greedy continuation of each chat prompt, computed once."""
    out = {}
    for q in CHAT_PROMPTS:
        prompt = tok.encode_chat([{"role": "user", "content": q}])
        out[q] = (prompt, _hf_greedy(hf_model, prompt, NEW_TOKENS))
    return out


@pytest.mark.parametrize("question", CHAT_PROMPTS)
def test_greedy_chat_matches_transformers(question, default_model, default_checkpoint, hf_model,
                                          hf_greedy, tok):
    # Teacher-forced greedy check: one causal forward of ours over prompt + transformers'
    # continuation; our argmax after every prefix must be transformers' next token. By induction
    # that is exactly "our greedy loop emits the same tokens" (the loop itself is tested below),
    # at one forward instead of one per token.
    prompt, ref = hf_greedy[question]
    eos = set(default_checkpoint.config.eos_token_ids)
    # transformers' eos plus the file's other end-of-generation tokens, as llama.cpp stops on them.
    assert hf_model.generation_config.eos_token_id in eos
    assert {tok.token(i) for i in eos} == {"<|im_end|>", "<|endoftext|>"}
    assert len(ref) == NEW_TOKENS or ref[-1] in eos  # transformers ran to the limit or to eos
    assert not eos & set(ref[:-1])
    seq = prompt + ref[:-1]
    with torch.no_grad():
        rows = torch.arange(len(prompt) - 1, len(seq))
        logits = default_model(torch.tensor(seq), torch.arange(len(seq)), NoCacheAttention([len(seq)]), rows)
    ours = logits.argmax(-1).tolist()
    assert ours == ref, f"ours: {tok.decode(ours)!r}\nhf:   {tok.decode(ref)!r}"
    text = tok.decode(ref)
    assert len(ref) >= 5 and text.strip()
    if "France" in question:
        assert "Paris" in text


def test_greedy_loop_matches_transformers(default_model, default_checkpoint, hf_greedy, tok):
    # The literal loop, recomputing the whole sequence each step and stopping at eos. The answer
    # to this prompt is short (it ends with <|im_end|>), which keeps the no-cache loop cheap.
    prompt, ref = hf_greedy[CHAT_PROMPTS[0]]
    ours = _ours_greedy(default_model, prompt, NEW_TOKENS, set(default_checkpoint.config.eos_token_ids))
    assert ours == ref
    assert ours[-1] in default_checkpoint.config.eos_token_ids
    assert "Paris" in tok.decode(ours)


def test_prompt_logits_match_transformers(default_model, hf_model, tok):
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in CHAT_PROMPTS[:2]]
    ids = torch.tensor([t for p in prompts for t in p])
    pos = torch.cat([torch.arange(len(p)) for p in prompts])
    with torch.no_grad():
        ours = default_model(ids, pos, NoCacheAttention([len(p) for p in prompts])).split(
            [len(p) for p in prompts])
        for got, p in zip(ours, prompts):
            ref = hf_model(torch.tensor([p])).logits[0]
            assert (got - ref).abs().max() < 1e-3
            assert torch.equal(got.argmax(-1), ref.argmax(-1))


# ---- tokenization ---------------------------------------------------------------------------

NO_DIGITS = [
    "", " ", "\n", "Hello, world!",
    "Héllo wörld, ça va? naïve café Ångström",
    "日本語のテキスト 中文字符 한국어",
    "emoji 🎉🚀 👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "   leading and trailing   ",
    "a  b   c    d     e",
    "tabs\tand\t\tmore\t\t\ttabs",
    "\n\nnewlines\n\n\nmore\r\nwindows\r\n",
    " \t \n mixed \n\t ",
    "don't I'll we're they've it's she'd I'M YOU'RE",
    "def f(x):\n    return x ** y  # comment\n\tif a != b: pass\n",
    "{\"key\": [true, null], 'q': `tick`} <div class=\"a\">&amp;</div>",
    "<|im_start|>user\nhi<|im_end|>",
    "text<|im_end|><|im_start|>assistant\nok",
]

WITH_DIGITS = [
    "2024", "The year 2024 had 366 days.", "pi = 3.14159, e = 2.71828",
    "x  2024", "a\n\n1. first\n2. second", "Total:\t\t42", "phone: +1 (555) 012-3456",
    "def f(x):\n    return x * 2 + 10\n", "½ x² H₂O", "  ½", "Arabic-Indic ١٢٣ digits",
]


@pytest.mark.parametrize("text", NO_DIGITS)
def test_tokenize_matches_transformers(text, tok, hf_tok):
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
    if "<|" not in text:
        assert tok.decode(ids) == text


@pytest.mark.parametrize("text", WITH_DIGITS)
def test_tokenize_digits_matches_smollm_pretokenizer(text, tok, hf_tok_digits):
    ids = tok.encode(text)
    assert ids == hf_tok_digits.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == text


def test_special_tokens_in_text(tok):
    assert tok.add_bos is False
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == SPECIAL_IDS["<|im_start|>"] and ids[-1] == SPECIAL_IDS["<|im_end|>"]
    assert ids.count(1) == 1 and ids.count(2) == 1
    assert tok.decode(ids) == "user\nhi"  # specials are skipped when decoding


def test_digit_split_divergence_from_transformers_gguf(tok, hf_tok, hf_tok_digits):
    # Known, deliberate divergence (see hf_tok_digits). SmolLM2's merges hold no digit merges, so a
    # digit run is one token per digit either way; the split shows where whitespace runs into a
    # digit: isolating the digit leaves "  " as its own piece (one merged token), while plain
    # GPT-2 regex splitting gives " " + " 2" (two single-space tokens, then the digit).
    for text in ("x  2024", "a\n\n1. b", "Total:\t\t42"):
        ours = tok.encode(text)
        assert ours == hf_tok_digits.encode(text, add_special_tokens=False).ids
        assert ours != hf_tok.encode(text, add_special_tokens=False)
    ours = tok.encode("x  2024")
    pieces = [tok.decode([i]) for i in ours]
    assert pieces == ["x", "  ", "2", "0", "2", "4"]
    plain = [hf_tok.decode([i]) for i in hf_tok.encode("x  2024", add_special_tokens=False)]
    assert plain == ["x", " ", " ", "2", "0", "2", "4"]


# ---- chat template ------------------------------------------------------------------------

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse pirate."},
     {"role": "user", "content": "Say hello.\nTwice, please."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke."}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["user", "system+user", "multi-turn"])
def test_chat_template_matches_transformers(messages, tok, hf_tok):
    ref = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.render_chat(messages) == ref
    assert ref.endswith("<|im_start|>assistant\n")
    assert tok.encode_chat(messages) == hf_tok.encode(ref, add_special_tokens=False)


# ---- streaming detokenization ----------------------------------------------------------------

@pytest.mark.parametrize("text", ["héllo 世界 🎉", "👨‍👩‍👧 ça, 日本語!", "plain ascii words"])
def test_stream_decodes_incrementally(text, tok):
    ids = tok.encode(text)
    stream = tok.stream()
    chunks = [stream.push(i) for i in ids]
    assert "".join(chunks) == tok.decode(ids) == text
    assert not any("\ufffd" in c for c in chunks)
    if not text.isascii():
        # The test is only meaningful if some characters really are split over several tokens.
        assert any("\ufffd" in tok.decode([i]) for i in ids)
        assert "" in chunks


def test_stream_skips_special_tokens(tok):
    ids = tok.encode("<|im_start|>assistant\nhéllo 🎉<|im_end|>")
    assert ids[0] == SPECIAL_IDS["<|im_start|>"] and ids[-1] == SPECIAL_IDS["<|im_end|>"]
    stream = tok.stream()
    chunks = [stream.push(i) for i in ids]
    assert "".join(chunks) == tok.decode(ids) == "assistant\nhéllo 🎉"
    assert chunks[0] == "" and chunks[-1] == ""
