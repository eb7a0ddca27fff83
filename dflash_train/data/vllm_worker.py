"""The vLLM side of `regenerate --engine vllm` when vLLM lives in another interpreter.

Run as `python -m dflash_train.data.vllm_worker SPEC_JSON` with this checkout on PYTHONPATH
(it imports only `dflash_train.data.regenerate`, which needs vLLM and nothing else of the
toolkit). Reads one JSON object per line on stdin, {"prompts": [[token ids]...], "seed": s},
and answers each with one stdout line `RESULT [[text, new_tokens, hit_max]...]`; vLLM's own
output may share stdout, so the reader keeps only RESULT lines. Exits at the end of stdin.
"""

from __future__ import annotations

import json
import sys

RESULT = "RESULT "


def main(argv: list[str]) -> None:
    from dflash_train.data.regenerate import _VLLMGenerator

    spec = json.loads(argv[0])
    gen = _VLLMGenerator(spec["target"], spec["stop_ids"], spec["max_new_tokens"], spec["temperature"],
                         spec.get("max_model_len"), spec.get("dtype", "auto"))
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        out = gen.generate(job["prompts"], seed=int(job.get("seed", 0)))
        sys.stdout.write(RESULT + json.dumps(out) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
