"""Tokenizers loaded on two threads at once in a fresh process (what `stoker serve --config`
does with a generative and a pooling model) both load: transformers' lazy imports are not
safe to race, so `load_tokenizer` serializes them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# A fresh interpreter: in this pytest process transformers is already imported, which hides the race.
_RACE = """
import sys, threading
from stoker.engine.tokenizer import load_tokenizer

paths = sys.argv[1:]
errors = []
barrier = threading.Barrier(len(paths))

def load(path):
    barrier.wait()  # start together: the first import of transformers happens on both threads
    try:
        load_tokenizer(path)
    except Exception as exc:
        errors.append(repr(exc))

threads = [threading.Thread(target=load, args=(p,)) for p in paths]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(errors or "ok")
"""


def test_two_threads_load_tokenizers_in_a_fresh_process(tmp_path: Path) -> None:
    from stoker.testing.tiny_checkpoint import demo_tokenizer_dir
    from stoker.testing.tiny_pooling import write_bert_tokenizer

    write_bert_tokenizer(tmp_path / "bert")  # a WordPiece (BertTokenizerFast) beside the demo's BPE
    script = tmp_path / "race.py"  # run as a file: under `python -c` the race showed less often
    script.write_text(_RACE)
    folders = [str(demo_tokenizer_dir()), str(tmp_path / "bert")] * 3  # six threads: more chances to collide
    # The race depends on timing: without the lock about half of these runs failed here, so five
    # runs catch it nearly always.
    for _ in range(5):
        out = subprocess.run([sys.executable, str(script), *folders], capture_output=True, text=True, timeout=300,
                             cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip().splitlines()[-1] == "ok", out.stdout[-2000:]
