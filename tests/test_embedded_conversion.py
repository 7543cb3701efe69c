"""The embedded model's first conversion, from an empty cache directory, on the installed transformers.

`make compat` runs this file on the oldest supported release (the project venv runs it on the newest):
the GGUF is unpacked by that release's own GGUF reader, so a release that cannot unpack it (5.0 has no
``GgufConfig``) or unpacks its tokenizer differently (5.0-5.5 add a BOS token the model was not trained
with; 5.6-5.19 name ``<|im_start|>`` as the end token) fails here. The expected values are the newest
release's conversion.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

PROMPT = "The sky is"
#: SmolLM2-135M-Instruct's tokens for PROMPT (no BOS) and its end token.
PROMPT_IDS = [504, 6376, 314]
EOS_ID = 2
#: 8 greedy tokens after PROMPT through an uncompressed cache, fp32 (transformers 5.24's conversion).
GREEDY_TEXT = " a canvas of colors, a canvas of"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(stdout, stderr, cache dir) of `kvslim sample` converting the embedded model into an empty cache dir."""
    cache = tmp_path_factory.mktemp("kvslim-cache")
    env = dict(os.environ, KVSLIM_CACHE_DIR=str(cache), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    code = "import sys; from kvslim.cli import main; sys.exit(main(sys.argv[1:]))"
    argv = ["sample", "--prompt", PROMPT, "--tokens", "8", "--temperature", "0", "--ignore-eos"]
    res = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, timeout=900
    )
    assert res.returncode == 0, res.stderr
    return res.stdout, res.stderr, cache


def test_first_conversion_generates_the_newest_releases_text(converted):
    out, err, _ = converted
    assert "converting the embedded model once" in err
    assert out.rstrip("\n") == GREEDY_TEXT


def test_converted_tokenizer_matches_the_newest_release(converted, monkeypatch):
    from transformers import AutoTokenizer

    from kvslim.models import converted_dir, embedded_gguf_path

    monkeypatch.setenv("KVSLIM_CACHE_DIR", str(converted[2]))
    tok = AutoTokenizer.from_pretrained(converted_dir(embedded_gguf_path()))
    assert tok(PROMPT)["input_ids"] == PROMPT_IDS
    assert tok.eos_token_id == EOS_ID and tok.pad_token_id == EOS_ID
