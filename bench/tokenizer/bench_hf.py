#!/usr/bin/env python3
"""Python `tokenizers` side of the tokenizer benchmark, same protocol as bench_hf.js:
    python3 bench_hf.py TOKENIZER_JSON DOCS_JSON REPS
Run through `spark_tokenizer_bench --hf python` where the Python library is installed (the
GPU machine); it avoids the Node binding's per-call async overhead."""
import json
import sys
import time


def main() -> int:
    from tokenizers import Tokenizer, __version__

    path, docs_path, reps = sys.argv[1], sys.argv[2], int(sys.argv[3] if len(sys.argv) > 3 else 3)
    tok = Tokenizer.from_file(path)
    with open(docs_path, encoding="utf-8") as f:
        docs = json.load(f)

    def encode_once():
        return [tok.encode(d, add_special_tokens=False).ids for d in docs]

    def decode_once(all_ids):
        for x in all_ids:
            tok.decode(x, skip_special_tokens=False)

    ids = encode_once()
    decode_once(ids)
    enc, dec = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        ids = encode_once()
        enc.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        decode_once(ids)
        dec.append(time.perf_counter() - t0)
    h, n = 0xCBF29CE484222325, 0
    for x in ids:
        for i in x:
            n += 1
            h = ((h ^ i) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    print(json.dumps({"library": f"tokenizers (Python) {__version__}",
                      "encode_s": sorted(enc)[len(enc) // 2], "decode_s": sorted(dec)[len(dec) // 2],
                      "tokens": n, "ids_fnv1a": format(h, "x")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
