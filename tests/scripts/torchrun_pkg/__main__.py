import runpy
from pathlib import Path

runpy.run_path(str(Path(__file__).parent.parent / "torchrun_style.py"), run_name="__main__")
