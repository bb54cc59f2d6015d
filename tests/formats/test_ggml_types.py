"""runlm's table of ggml types is gguf-py's: every enum value, name and block size."""
import subprocess
import sys

import gguf

from runlm.formats.ggml_types import BY_NAME, BY_VALUE


def test_the_table_is_gguf_pys():
    theirs = {t.value: (t.name, *gguf.GGML_QUANT_SIZES[t]) for t in gguf.GGMLQuantizationType
              if t in gguf.GGML_QUANT_SIZES}
    assert {v: (t.name, t.block, t.type_size) for v, t in BY_VALUE.items()} == theirs
    assert all(BY_NAME[t.name] is t for t in BY_VALUE.values())


def test_reading_a_header_does_not_import_gguf_py(tmp_path):
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("t.weight", __import__("numpy").zeros((2, 32), dtype="float32"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    code = ("import sys\nfrom runlm.formats.gguf import GGUFFile\n"
            f"f = GGUFFile({str(path)!r})\nassert f.tensors['t.weight'].qtype == 'F32'\n"
            "print(sorted(m for m in ('gguf', 'sentencepiece', 'yaml', 'tqdm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
