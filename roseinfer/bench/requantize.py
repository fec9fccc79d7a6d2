"""Write a GGUF's weights again in another format (gguf-py's quantizers), metadata kept.

For measuring formats on a real model's weights (the quality gate on the default
model in each format gguf-py can write): every quantized or 2-D tensor is dequantized
(``gguf.quants.dequantize``) and quantized to ``fmt``; 1-D F32 tensors (norms, biases)
stay as they are. Not a converter for users: it needs the whole tensor in fp32 at once.

    python -m roseinfer.bench.requantize SRC.gguf DST.gguf Q8_0
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType

FORMATS = ("F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")  # what gguf-py writes


def _copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter, fmt: str) -> None:
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the writer writes these itself
        if key == "general.file_type":
            continue  # no longer true
        vtype = field.types[0]
        sub = field.types[1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    writer.add_string("general.requantized_to", fmt)


def _requantized(tensor: gguf.ReaderTensor, qtype: QT) -> tuple[np.ndarray, QT]:
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
    if values.ndim < 2:
        return values, QT.F32
    if qtype == QT.F16:
        return values.astype(np.float16), qtype
    return gguf.quants.quantize(values, qtype), qtype


def requantize(src: Path, dst: Path, fmt: str) -> Path:
    """Write ``src``'s model to ``dst`` with every 2-D tensor in ``fmt``."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: gguf-py writes {', '.join(FORMATS)}")
    qtype = QT[fmt]
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    _copy_metadata(reader, writer, fmt)
    for tensor in reader.tensors:
        data, out_type = _requantized(tensor, qtype)
        writer.add_tensor(tensor.name, data,  # numpy order (rows first); quantized: bytes
                          raw_dtype=None if out_type in (QT.F32, QT.F16) else out_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p.add_argument("format", choices=FORMATS)
    args = p.parse_args()
    print(requantize(args.src, args.dst, args.format))


if __name__ == "__main__":
    main()
