"""Tokenizer and chat template, on top of Hugging Face ``tokenizers`` and ``jinja2``.

A GGUF file has no ``tokenizer.json``: for ``gpt2``-type vocabularies we rebuild the byte-level
BPE from its tokens and merges, with the pre-tokenizer its ``tokenizer.ggml.pre`` names (the
regex split the merges were learned with). Control tokens become special added tokens, so text
that spells ``<|im_start|>`` encodes to that one id, as in transformers and llama.cpp.

Invariants:
- ``encode`` never adds anything but the BOS token the model asks for (``add_bos``); a chat
  template's output is encoded without it (the template writes its own specials).
- ``TextStream`` only ever yields complete UTF-8: a multi-byte character split over tokens is
  held back until its last byte arrives (``tokenizers.decoders.DecodeStream``).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer, decoders, models, normalizers, pre_tokenizers

# Split regexes of llama.cpp's pre-tokenizer types that differ from plain GPT-2.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama3": _LLAMA3, "llama-bpe": _LLAMA3, "llama-v3": _LLAMA3, "smaug-bpe": _LLAMA3,
           "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2}
# Pre-tokenizers that are GPT-2's regex after splitting every digit on its own
# (SmolLM's tokenizer.json: Digits(individual_digits) then ByteLevel; llama.cpp's "smollm").
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact"}
# Qwen2/Qwen3's tokenizer.json NFC-normalises text before splitting (llama.cpp does not; we follow
# the model's own tokenizer, which is what the vocabulary was trained on).
_NFC = {"qwen2"}

TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4


class TokenizerError(ValueError):
    pass


def _pre_tokenizer(pre: str | None):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return byte_level


def bpe_from_gguf(tokens: list[str], merges: list[str], token_types: list[int] | None,
                  pre: str | None) -> HFTokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, ignore_merges=False))
    tok.pre_tokenizer = _pre_tokenizer(pre)
    if pre in _NFC:
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    types = token_types or []
    special = [AddedToken(tokens[i], special=True, normalized=False)
               for i, t in enumerate(types) if t == TOKEN_CONTROL]
    user = [AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(types) if t == TOKEN_USER_DEFINED]
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)
    return tok


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


class Tokenizer:
    def __init__(self, tok: HFTokenizer, *, bos_id: int | None, eos_ids: list[int],
                 chat_template: str | None, add_bos: bool, eos_token: str | None = None):
        self.tok = tok
        self.bos_id, self.eos_ids, self.add_bos = bos_id, eos_ids, add_bos
        # What a chat template calls eos_token: the tokenizer's own (Llama-3: <|eot_id|>), which
        # need not be the first of the ids generation stops on.
        self.eos_token = eos_token if eos_token is not None else self.token(eos_ids[0]) if eos_ids else None
        self.chat_template = chat_template
        self._template = None
        if chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, indent=indent, ensure_ascii=False)
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(chat_template)

    def __reduce__(self):
        # The jinja environment does not pickle; rebuild it from the template's source (this is
        # how the tokenizer travels to Ray workers with the rest of the checkpoint).
        return (_rebuild, (self.tok, self.bos_id, self.eos_ids, self.chat_template, self.add_bos, self.eos_token))

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def token(self, i: int) -> str | None:
        return self.tok.id_to_token(i)

    def encode(self, text: str) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise TokenizerError("this model has no chat template; pass --raw or give a plain prompt")
        bos = self.tok.id_to_token(self.bos_id) if self.bos_id is not None else ""
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=bos or "", eos_token=self.eos_token or "")

    def encode_chat(self, messages: list[dict]) -> list[int]:
        # The template writes its own special tokens; adding BOS again would double it.
        return self.tok.encode(self.render_chat(messages), add_special_tokens=False).ids

    def stream(self) -> "TextStream":
        return TextStream(self.tok)

    # ---- loaders -------------------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: Path, eos_ids: list[int], bos_id: int | None) -> "Tokenizer | None":
        tj = path / "tokenizer.json"
        if not tj.exists():
            return None
        tok = HFTokenizer.from_file(str(tj))
        conf = {}
        if (path / "tokenizer_config.json").exists():
            conf = json.loads((path / "tokenizer_config.json").read_text())
        template = conf.get("chat_template")
        if template is None and (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)

        def tid(key):
            v = conf.get(key)
            v = v.get("content") if isinstance(v, dict) else v
            return tok.token_to_id(v) if v else None

        bos = tid("bos_token") if tid("bos_token") is not None else bos_id
        eos = list(eos_ids)
        if tid("eos_token") is not None and tid("eos_token") not in eos:
            eos.append(tid("eos_token"))
        add_bos = conf.get("add_bos_token")
        if add_bos is None:  # Llama-3: tokenizer.json's post-processor adds <|begin_of_text|>
            add_bos = bos is not None and tok.encode("a", add_special_tokens=True).ids[:1] == [bos]
        eos_token = tok.id_to_token(tid("eos_token")) if tid("eos_token") is not None else None
        return cls(tok, bos_id=bos, eos_ids=eos, chat_template=template, add_bos=bool(add_bos),
                   eos_token=eos_token)


def _rebuild(tok, bos_id, eos_ids, chat_template, add_bos, eos_token) -> Tokenizer:
    return Tokenizer(tok, bos_id=bos_id, eos_ids=eos_ids, chat_template=chat_template, add_bos=add_bos,
                     eos_token=eos_token)


class TextStream:
    """Incremental detokenizer for one sequence: ``push(id)`` returns the new complete text."""

    def __init__(self, tok: HFTokenizer):
        self._tok = tok
        self._stream = decoders.DecodeStream(skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        return self._stream.step(self._tok, token_id) or ""
