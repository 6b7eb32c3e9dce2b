"""models.gguf_parsed_once: one GGUF parse and one tensor-name map per conversion."""

import gguf
import numpy as np
import pytest

from rlvr_lightning.models import gguf_parsed_once


def _write_gguf(path, value: int) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("test.value", value)
    writer.add_tensor("blk.0.attn_q.weight", np.full((2, 4), value, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_one_reader_per_file_and_one_map_per_arch_within(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    _write_gguf(a, 3)
    _write_gguf(b, 5)
    with gguf_parsed_once():
        first = gguf.GGUFReader(a)
        assert gguf.GGUFReader(str(a)) is first  # same file, path or str: the same reader
        other = gguf.GGUFReader(b)
        assert other is not first
        assert int(first.fields["test.value"].contents()) == 3
        assert int(other.fields["test.value"].contents()) == 5
        assert np.all(other.tensors[0].data == 5)
        names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is names
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 3) is not names
        assert names.get_name("model.layers.1.self_attn.q_proj") == "blk.1.attn_q"
    assert isinstance(gguf.GGUFReader(a), gguf.GGUFReader)  # the class again
    assert gguf.GGUFReader(a) is not gguf.GGUFReader(a)


def test_restored_when_the_conversion_fails(tmp_path):
    reader_cls, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with pytest.raises(RuntimeError, match="boom"), gguf_parsed_once():
        assert gguf.GGUFReader is not reader_cls
        raise RuntimeError("boom")
    assert gguf.GGUFReader is reader_cls and gguf.get_tensor_name_map is name_map
