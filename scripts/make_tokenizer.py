"""Regenerate the shipped tiny tokenizer in ``extproc/tokenize/data/tiny/`` from a seeded corpus.

Run from the repository root: ``python scripts/make_tokenizer.py`` (or ``--out DIR`` to write
elsewhere). The output is committed so the router and the simulator need no download;
``tests/tokenize/test_make_tokenizer.py`` regenerates into a temporary folder and fails when the
committed files differ byte for byte.

The tokenizer is a byte-level BPE shaped like Llama-3's ``tokenizer.json`` (same pre-tokenizer
regex, ByteLevel decoder, a TemplateProcessing post-processor that prepends ``<|begin_of_text|>``),
trained on synthetic text: English-like sentences, numbers, code, JSON and some non-ASCII so the
byte fallback is exercised. Output is deterministic because the corpus is seeded and training runs
on one thread (rayon's pool size is read once, so it is set before ``tokenizers`` is imported).
"""

from __future__ import annotations

import os

os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import argparse
import json
import random
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "extproc" / "tokenize" / "data"
DEFAULT_OUT = DATA / "tiny"
TEMPLATE = DATA / "templates" / "llama3.jinja"

SEED = 20240917
LINES = 30_000
VOCAB_SIZE = 5000
# Fixed order: ids 0..7 never move, whatever the corpus.
SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
]
BOS, EOS = "<|begin_of_text|>", "<|eot_id|>"
# Llama-3's pre-tokenizer split: contractions, letter runs, 1-3 digit groups, punctuation, spaces.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _words(text: str) -> list[str]:
    return text.split()


NOUNS = _words(
    "time year people way day man woman child world life hand part place case week company system "
    "program question work government number night point home water room mother area money story "
    "fact month lot right study book eye job word business issue side kind head house service friend "
    "father power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war history "
    "party result change morning reason research girl guy moment air teacher force education model "
    "server request token cache queue router endpoint cluster node pod gateway prompt answer weather"
)
VERBS = _words(
    "be have do say go get make know think take see come want look use find give tell work call try "
    "ask need feel become leave put mean keep let begin seem help talk turn start show hear play run "
    "move like live believe hold bring happen write provide sit stand lose pay meet include continue "
    "set learn change lead understand watch follow stop create speak read allow add spend grow open "
    "walk win offer remember love consider appear buy wait serve die send expect build stay fall cut "
    "reach kill remain suggest raise pass sell require report decide pull route schedule cache stream"
)
ADJECTIVES = _words(
    "good new first last long great little own other old right big high different small large next "
    "early young important few public bad same able fast slow quiet busy ready empty full warm cold "
    "bright dark simple clear strong local recent free true whole real best better sure open happy"
)
ADVERBS = _words("quickly slowly often never always really very still already soon again together almost")
FUNCTION = _words("the a an this that my your our their some every no")
PREPS = _words("in on at with from into over under after before about through between during")
NAMES = _words("Alice Bob Carol Dave Erin Frank Grace Heidi Ivan Judy Mallory Oscar Peggy Trent Victor")
UNICODE_WORDS = _words(
    "café naïve résumé façade Zürich München São Paulo Ångström niño señor crème brûlée Straße "
    "Ελλάδα αβγ Привет мир спасибо 東京 北京 日本語 你好 世界 こんにちは 서울 مرحبا שלום हिन्दी"
)
EMOJI = ["🙂", "🚀", "🎉", "👍", "❤️", "🔥", "✅", "🤖", "🌍", "☕"]
PUNCT_END = [".", ".", ".", "!", "?", "...", ";"]
CODE_NAMES = _words("x y i n idx count total items result value key data config request response node")
ONSETS = _words("b c d f g h j k l m n p r s t v w z br ch cl cr dr fl gr pl pr sh st th tr")
VOWELS = _words("a e i o u a e i o ai ea ou")
CODAS = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck"]


def _lexicon(r: random.Random, size: int) -> list[str]:
    """Pseudo-words built from syllables: a long tail of rare words, so the vocabulary keeps growing."""
    words: set[str] = set()
    while len(words) < size:
        syllables = r.choice([1, 2, 2, 2, 3, 3, 4])
        words.add("".join(r.choice(ONSETS) + r.choice(VOWELS) + r.choice(CODAS) for _ in range(syllables)))
    return sorted(words)


PSEUDO = _lexicon(random.Random(1), 6000)


def _sentence(r: random.Random) -> str:
    """One English-like sentence with the odd name, number, quote or non-ASCII word."""
    words = [r.choice(FUNCTION), r.choice(ADJECTIVES), r.choice(NOUNS), r.choice(VERBS) + r.choice(["", "s"])]
    if r.random() < 0.5:
        words += [r.choice(PREPS), r.choice(FUNCTION), r.choice(NOUNS)]
    if r.random() < 0.3:
        words.insert(r.randrange(len(words)), r.choice(ADVERBS))
    if r.random() < 0.2:
        words.insert(0, r.choice(NAMES) + ",")
    if r.random() < 0.15:
        words.append(r.choice(UNICODE_WORDS))
    for _ in range(r.choice([0, 0, 1, 2, 3])):
        # Zipf-like: low indices are common (become whole tokens), the tail stays in pieces.
        words.insert(r.randrange(len(words) + 1), PSEUDO[min(int(r.paretovariate(0.7)) - 1, len(PSEUDO) - 1)])
    if r.random() < 0.1:
        words.append(f"{r.randint(0, 10_000)}")
    text = " ".join(words)
    text = text[0].upper() + text[1:] + r.choice(PUNCT_END)
    if r.random() < 0.1:
        text = f'"{text}" {r.choice(NAMES)} said.'
    if r.random() < 0.08:
        text += " " + r.choice(EMOJI)
    if r.random() < 0.1:
        text = text.replace(" is ", " isn't ").replace(" do ", " don't ")
    return text


def _paragraph(r: random.Random) -> str:
    return " ".join(_sentence(r) for _ in range(r.randint(1, 4)))


def _numbers(r: random.Random) -> str:
    """Dates, prices, versions and measurements: digits split into 1-3 digit groups."""
    return r.choice(
        [
            f"{r.randint(1990, 2030)}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}",
            f"${r.randint(1, 999)}.{r.randint(0, 99):02d}",
            f"v{r.randint(0, 9)}.{r.randint(0, 20)}.{r.randint(0, 99)}",
            f"{r.randint(0, 100)}% of {r.randint(1, 100_000)} requests took {r.random() * 100:.2f} ms",
            f"{r.randint(0, 23):02d}:{r.randint(0, 59):02d}:{r.randint(0, 59):02d}",
            f"{r.randint(-1000, 1000)} + {r.randint(0, 1000)} = ?",
        ]
    )


def _code(r: random.Random) -> str:
    """A few lines of Python, JavaScript or shell, indentation included."""
    a, b = r.choice(CODE_NAMES), r.choice(CODE_NAMES)
    return r.choice(
        [
            f"def {r.choice(VERBS)}_{r.choice(NOUNS)}({a}, {b}=None):\n    return {a} + {b}\n",
            f"for {a} in range({r.randint(1, 100)}):\n    if {a} % 2 == 0:\n        print({a})\n",
            f"const {a} = {{ {b}: {r.randint(0, 99)}, name: '{r.choice(NAMES)}' }};\n",
            f"import {r.choice(['os', 'sys', 'json', 'asyncio'])}\nfrom typing import Any\n",
            f"$ curl -s http://127.0.0.1:{r.randint(1024, 65535)}/v1/{r.choice(['models', 'health'])}\n",
            f"class {r.choice(NOUNS).title()}{r.choice(NOUNS).title()}:\n    pass\n",
            f"if ({a} != null && {b}.length > {r.randint(0, 9)}) {{ return {a}; }}\n",
        ]
    )


def _json(r: random.Random) -> str:
    """JSON objects like tool schemas, tool calls and API bodies."""
    obj: dict[str, object] = r.choice(
        [
            {"name": f"get_{r.choice(NOUNS)}", "arguments": {r.choice(CODE_NAMES): r.choice(UNICODE_WORDS)}},
            {
                "type": "function",
                "function": {
                    "name": f"{r.choice(VERBS)}_{r.choice(NOUNS)}",
                    "description": _sentence(r),
                    "parameters": {
                        "type": "object",
                        "properties": {r.choice(CODE_NAMES): {"type": "string"}},
                    },
                },
            },
            {"role": r.choice(["system", "user", "assistant", "tool"]), "content": _sentence(r)},
            {
                "id": r.randint(0, 10**6),
                "ok": r.random() < 0.5,
                "items": [r.randint(0, 99) for _ in range(3)],
            },
        ]
    )
    return json.dumps(obj, ensure_ascii=r.random() < 0.3, indent=r.choice([None, 2]))


def _chat(r: random.Random) -> str:
    return f"{r.choice(['user', 'assistant', 'system', 'tool'])}\n\n{_paragraph(r)}"


GENERATORS: list[tuple[float, Callable[[random.Random], str]]] = [
    (0.45, _paragraph),
    (0.12, _numbers),
    (0.15, _code),
    (0.13, _json),
    (0.15, _chat),
]


def corpus(seed: int = SEED, lines: int = LINES) -> Iterator[str]:
    """The training text, one document at a time; the same seed gives the same documents."""
    r = random.Random(seed)
    weights = [w for w, _ in GENERATORS]
    funcs = [f for _, f in GENERATORS]
    for _ in range(lines):
        yield r.choices(funcs, weights)[0](r)


def train(seed: int = SEED, lines: int = LINES, vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Train the byte-level BPE and attach Llama-3's pre-tokenizer, decoder and BOS post-processor."""
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(seed, lines), trainer=trainer, length=lines)
    bos_id = SPECIAL_TOKENS.index(BOS)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS}:0 $A:0",
                pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1",
                special_tokens=[(BOS, bos_id)],
            ),
        ]
    )
    return tok


def tokenizer_config(chat_template: str) -> dict[str, object]:
    """``tokenizer_config.json`` as Hugging Face writes it (sorted keys, AddedToken entries)."""
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    return {
        # Explicit, so transformers >= 5 and our loader rebuild the same BOS-only post-processor.
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "bos_token": BOS,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 131072,
        "pad_token": "<|end_of_text|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def generate(out: Path) -> list[Path]:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``out``; return the paths."""
    out.mkdir(parents=True, exist_ok=True)
    tok = train()
    tok_path = out / "tokenizer.json"
    tok_path.write_text(tok.to_str(pretty=False) + "\n", encoding="utf-8")
    cfg_path = out / "tokenizer_config.json"
    cfg = tokenizer_config(TEMPLATE.read_text(encoding="utf-8"))
    cfg_path.write_text(
        json.dumps(cfg, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    return [tok_path, cfg_path]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: %(default)s)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(f"wrote {path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
