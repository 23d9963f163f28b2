#!/usr/bin/env python3
"""Writes a reference.json for any tokenizer.json with the Python `tokenizers` library, in
the format tests/daemon/tokenizer_reference_test.cc reads (the same the npm generator
writes). Use it where PyPI is reachable (the GPU machine) to check our tokenizer against
real vendor files (Llama 3.x, Qwen2.5/3, Mistral-Nemo):

  python3 tools/tokenizer/gen_reference.py MODEL_DIR/tokenizer.json OUT_DIR \\
      [--corpus tools/tokenizer/corpus/test_corpus.json] [--train tools/tokenizer/corpus/train.txt]

OUT_DIR receives tokenizer.json (copied), reference.json and, when MODEL_DIR has one,
tokenizer_config.json. Then: SPARK_TOKENIZER_REF_DIRS=OUT_DIR ./build/tests/spark_unit_tests
-tc='*external*' compares ours with it.
"""
import argparse
import json
import os
import random
import shutil
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("tokenizer_json")
    ap.add_argument("out_dir")
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--corpus", default=os.path.join(here, "corpus/test_corpus.json"))
    ap.add_argument("--train", default=os.path.join(here, "corpus/train.txt"))
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()

    from tokenizers import Tokenizer, __version__  # pip install tokenizers

    tok = Tokenizer.from_file(args.tokenizer_json)
    with open(args.corpus, encoding="utf-8") as f:
        texts = json.load(f)
    with open(args.train, encoding="utf-8") as f:
        train = f.read()
    texts += train.split("\n") + [train]
    rng = random.Random(7)
    for _ in range(40):
        a = rng.randrange(len(train))
        texts.append(train[a : a + 1 + rng.randrange(60)])

    cases = []
    for text in texts:
        plain = tok.encode(text, add_special_tokens=False).ids
        special = tok.encode(text, add_special_tokens=True).ids
        cases.append({
            "text": text, "ids": plain, "ids_with_special": special,
            "decoded": tok.decode(special, skip_special_tokens=False),
            "decoded_skip_special": tok.decode(special, skip_special_tokens=True),
        })
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    # Ids drawn below the largest id; sparse vocabularies may have holes, decode skips them.
    max_id = max(tok.get_vocab(with_added_tokens=True).values()) + 1
    r = random.Random(args.seed)
    decode_cases = []
    for _ in range(60):
        ids = [r.randrange(max_id) for _ in range(1 + r.randrange(12))]
        decode_cases.append({
            "ids": ids,
            "text": tok.decode(ids, skip_special_tokens=False),
            "text_skip_special": tok.decode(ids, skip_special_tokens=True),
        })
    os.makedirs(args.out_dir, exist_ok=True)
    dst = os.path.join(args.out_dir, "tokenizer.json")
    if os.path.abspath(dst) != os.path.abspath(args.tokenizer_json):
        shutil.copyfile(args.tokenizer_json, dst)
    cfg = os.path.join(os.path.dirname(args.tokenizer_json), "tokenizer_config.json")
    if os.path.exists(cfg):
        shutil.copyfile(cfg, os.path.join(args.out_dir, "tokenizer_config.json"))
    out = {
        "generator": f"tools/tokenizer/gen_reference.py with tokenizers {__version__}",
        "vocab_size": max_id, "cases": cases, "decode_cases": decode_cases,
    }
    with open(os.path.join(args.out_dir, "reference.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False)
        f.write("\n")
    print(f"{args.out_dir}: {len(cases)} encode cases, {len(decode_cases)} decode cases, vocab {vocab_size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
