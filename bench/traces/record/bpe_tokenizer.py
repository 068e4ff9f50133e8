"""A byte-level BPE tokenizer trained on the task's own text, loadable with ``AutoTokenizer``.

    python -m bench.traces.record.bpe_tokenizer --out bpe_tokenizer --vocab-size 384

Trained with ``tokenizers`` on prompt + warm-start transcripts, so tokens are chunks of the
task's text (``" yes"``, ``"back"``, ``"answer"``, number pieces), not characters. The
pre-tokenizer is GPT-2's byte-level split (digits, letters and punctuation runs apart), as in the
tokenizers of real models; with ``digits_apart`` (the search trace's default) every run of digits
is a piece of its own first, so a number is the same token wherever it stands (``"=9"``, ``" 9"``,
``"(9"``: the space before it is a token ``" "``) and copying a number is copying a token (with
GPT-2's split, ``"9"`` and ``" 9"`` are different tokens: a 0.4M policy copied the target wrongly
in about 40% of its check lines). Specials as in the char tokenizer: ``<pad>``, ``<bos>``, ``<eos>``,
``<unk>`` (ids 0..3); encoding a text adds ``<bos>`` in front, the recorder appends ``<eos>``.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from bench.traces.record.tokenizer import BOS, EOS, PAD, SPECIALS, UNK


def train_tokenizer(texts: Iterable[str], vocab_size: int = 384,
                    digits_apart: bool = False) -> PreTrainedTokenizerFast:
    """A BPE tokenizer of at most ``vocab_size`` tokens trained on ``texts`` (deterministic)."""
    core = Tokenizer(models.BPE(unk_token=UNK))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\d+"), behavior="isolated"),
                                                   byte_level]) if digits_apart else byte_level)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  min_frequency=2)
    core.train_from_iterator(list(texts), trainer=trainer)
    bos = core.token_to_id(BOS)
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos)])
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, bos_token=BOS,
                                   eos_token=EOS, unk_token=UNK, padding_side="left",
                                   clean_up_tokenization_spaces=False)


def main() -> None:
    from bench.traces.record import search_task

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--vocab-size", type=int, default=384)
    ap.add_argument("--gpt2-digits", action="store_true", help="GPT-2's split (a space joins the digits after it)")
    args = ap.parse_args()
    texts = search_task.corpus(search_task.make_problems(200, seed=0), seed=0)
    tok = train_tokenizer(texts, args.vocab_size, digits_apart=not args.gpt2_digits)
    tok.save_pretrained(str(args.out))
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(args.out))
    ids = tok(texts[0])["input_ids"]
    print(f"saved {len(tok)} tokens to {args.out}; a {len(texts[0])}-character transcript is "
          f"{len(ids)} tokens: {tok.convert_ids_to_tokens(ids[:16])}")


if __name__ == "__main__":
    main()
