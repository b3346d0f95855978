"""Builds ``pcgspec/training/subjects.txt``, the everyday subjects the EAGLE3 trainer's prompts
ask about, from the nouns of WordNet 3.0 as Debian's ``wordnet-base`` package ships them:

    apt-get download wordnet-base && dpkg-deb -x wordnet-base_*.deb /tmp/wn
    python scripts/build_subjects.py --wordnet /tmp/wn/usr/share/wordnet

A noun lemma is kept when it is lowercase letters in one or two words, the default model's
tokenizer writes it (after a space) in at most two tokens (byte-pair merges follow frequency)
and each of its words appears at least three times in WordNet's definitions, which use
everyday words: this keeps "lighthouse" and "scrambled eggs" and drops "laelia", "abruption"
and "arc cosine". Lemmas
that share a word with a chat question of ``scripts/bench_spec.py`` are dropped, so the
benchmark's questions stay unseen by the head.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "pcgspec" / "training" / "subjects.txt"
MAX_TOKENS = 2
MIN_GLOSS_COUNT = 3
NOTICE = """\
# Everyday subjects for pcgspec's EAGLE3 prompts: noun lemmas of WordNet 3.0 (Debian's
# wordnet-base 1:3.0), filtered by scripts/build_subjects.py. WordNet's license asks that this
# notice travel with every copy:
#
# WordNet 3.0 Copyright 2006 by Princeton University. All rights reserved. Permission to use,
# copy, modify and distribute this software and database and its documentation for any purpose
# and without fee or royalty is hereby granted, provided that you agree to comply with the
# following copyright notice and statements, including the disclaimer, and that the same appear
# on ALL copies of the software, database and documentation, including modifications that you
# make for internal use or for distribution. THIS SOFTWARE AND DATABASE IS PROVIDED "AS IS" AND
# PRINCETON UNIVERSITY MAKES NO REPRESENTATIONS OR WARRANTIES, EXPRESS OR IMPLIED. BY WAY OF
# EXAMPLE, BUT NOT LIMITATION, PRINCETON UNIVERSITY MAKES NO REPRESENTATIONS OR WARRANTIES OF
# MERCHANTABILITY OR FITNESS FOR ANY PARTICULAR PURPOSE OR THAT THE USE OF THE LICENSED
# SOFTWARE, DATABASE OR DOCUMENTATION WILL NOT INFRINGE ANY THIRD PARTY PATENTS, COPYRIGHTS,
# TRADEMARKS OR OTHER RIGHTS. The name of Princeton University or Princeton may not be used in
# advertising or publicity pertaining to distribution of the software and/or database. Title to
# copyright in this software, database and any associated documentation shall at all times
# remain with Princeton University and LICENSEE agrees to preserve same.
"""


def noun_lemmas(wordnet: Path) -> set[str]:
    """Every noun lemma of ``data.noun`` (a synset's words: count in hex, then word/lex-id
    pairs), underscores as spaces, adjective markers like ``(a)`` removed."""
    lemmas = set()
    for line in (wordnet / "data.noun").read_text(encoding="latin-1").splitlines():
        if line.startswith(" "):  # the license header
            continue
        fields = line.split()
        lemmas.update(re.sub(r"\(.*\)$", "", fields[4 + 2 * i]).replace("_", " ")
                      for i in range(int(fields[3], 16)))  # fmt: skip
    return lemmas


def gloss_counts(wordnet: Path) -> Counter[str]:
    """How often each lowercase word appears in the definitions (after ``|``) of every part of
    speech."""
    counts: Counter[str] = Counter()
    for part in ("noun", "verb", "adj", "adv"):
        for line in (wordnet / f"data.{part}").read_text(encoding="latin-1").splitlines():
            if not line.startswith(" ") and "|" in line:
                counts.update(re.findall(r"[a-z]+", line.split("|", 1)[1].lower()))
    return counts


def benchmark_words() -> set[str]:
    """The words of ``bench_spec.py``'s chat questions, also without a plural ``s``."""
    spec = importlib.util.spec_from_file_location("bench_spec", ROOT / "scripts" / "bench_spec.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_spec"] = bench  # NOTE: dataclasses look their module up there
    spec.loader.exec_module(bench)
    words = {w for q in bench.PROMPT_SETS["chat"] for w in re.findall(r"[a-z]+", q.lower())}
    return words | {w[:-1] for w in words if w.endswith("s")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--wordnet", type=Path, required=True,
                   help="WordNet 3.0's dict folder (holds data.noun)")  # fmt: skip
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer folder (default: the default model's)")  # fmt: skip
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    from transformers import AutoTokenizer

    if args.tokenizer is None:
        from pcgspec.models.default_model import default_model_path

        args.tokenizer = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    unseen, counts = benchmark_words(), gloss_counts(args.wordnet)
    subjects = sorted(
        lemma for lemma in noun_lemmas(args.wordnet)
        if re.fullmatch(r"[a-z]+( [a-z]+)?", lemma) and not unseen & set(lemma.split())
        and min(counts[w] for w in lemma.split()) >= MIN_GLOSS_COUNT
        and len(tokenizer.encode(" " + lemma, add_special_tokens=False)) <= MAX_TOKENS
    )  # fmt: skip
    args.out.write_text(NOTICE + "".join(s + "\n" for s in subjects))
    print(f"{len(subjects)} subjects -> {args.out}")


if __name__ == "__main__":
    main()
