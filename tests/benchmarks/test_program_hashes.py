"""benchmarks/program_hashes.py: the canonical HLO keeps every instruction and drops only what names the source."""

HLO = """HloModule jit_step, is_scheduled=true, entry_computation_layout={(f32[2]{0})->f32[2]{0}}

FileNames
1 "/work/main/ptx/train/NAME.py"

FunctionNames
1 "step"

FileLocations
1 {file_name_id=1 function_name_id=1 line=10 end_line=10 column=2 end_column=9}

StackFrames
1 {file_location_id=1 parent_frame_id=1}

ENTRY %main.3 (x.1: f32[2]) -> f32[2] {
  %x.1 = f32[2]{0} parameter(0), metadata={op_name="x" source_file="/work/main/ptx/train/NAME.py"}
  ROOT %OP.2 = f32[2]{0} OP(%x.1, %x.1), metadata={op_name="jit(step)/OP"}, stack_frame_id=1
}
"""


def _hlo(source: str, op: str) -> str:
  """HLO of one `op`, traced from ptx/train/`source`.py."""
  return HLO.replace("NAME", source).replace("OP", op)


def test_a_moved_source_file_leaves_the_canonical_text_alone_and_another_op_does_not(import_benchmark):
  hashes = import_benchmark("program_hashes")
  moved = hashes.canonical(_hlo("rl_step", "add"))
  assert moved == hashes.canonical(_hlo("grpo/update", "add"))
  assert moved != hashes.canonical(_hlo("rl_step", "multiply"))
  assert "rl_step" not in moved and "stack_frame_id" not in moved and "metadata" not in moved
  assert "ROOT %add.2 = f32[2]{0} add(%x.1, %x.1)" in moved and "entry_computation_layout" in moved
