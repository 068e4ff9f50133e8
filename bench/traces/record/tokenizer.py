"""A character-level tokenizer for the recorder's task, loadable with ``AutoTokenizer``.

    python -m bench.traces.record.tokenizer --out char_tokenizer

One token per character of ``ALPHABET`` plus ``<pad>``, ``<bos>``, ``<eos>``, ``<unk>``. Encoding
a text adds ``<bos>`` in front (so a prompt is ready to generate from); the recorder appends
``<eos>`` to SFT answers itself.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = [PAD, BOS, EOS, UNK]  # ids 0..3
ALPHABET = "0123456789+-*/()=>: "


def build_tokenizer(alphabet: str = ALPHABET) -> PreTrainedTokenizerFast:
    """A fast tokenizer with one id per special token and per character of ``alphabet``."""
    if len(set(alphabet)) != len(alphabet):
        raise ValueError(f"alphabet {alphabet!r} repeats a character")
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({ch: len(SPECIALS) + i for i, ch in enumerate(alphabet)})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])])
    core.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, bos_token=BOS,
                                   eos_token=EOS, unk_token=UNK, padding_side="left",
                                   clean_up_tokenization_spaces=False)


def save_tokenizer(out: Path, alphabet: str = ALPHABET) -> PreTrainedTokenizerFast:
    tok = build_tokenizer(alphabet)
    tok.save_pretrained(str(out))
    return tok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    save_tokenizer(args.out)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(args.out))
    ids = tok("3 5 7>15:")["input_ids"]
    print(f"saved {len(tok)} tokens to {args.out}; '3 5 7>15:' -> {ids} -> "
          f"{tok.decode(ids, skip_special_tokens=True)!r}")


if __name__ == "__main__":
    main()
