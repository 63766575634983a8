"""The roofline of a compiled program (`spmdkit.inspect.roofline`) on a hand-written scheduled HLO module whose
FLOPs and bytes are counted by hand below: a GEMM fusion, an elementwise fusion named by its stack frames, a loop
of three in-place updates of a stacked buffer, a fill, an async all-reduce, a copy and an optimizer-named kernel.
The compiled programs of real strategies are covered in test_gpu_compile.py and test_pipeline.py."""

import pytest

from spmdkit.inspect.roofline import kind_table, roofline

HLO = """HloModule hand, is_scheduled=true

FileNames
1 "/site-packages/spmdkit/models/layers.py"
2 "/site-packages/spmdkit/train/step.py"

FunctionNames
1 "rms_norm"
2 "step"

FileLocations
1 {file_name_id=1 function_name_id=1 line=3 end_line=3 column=1 end_column=2}
2 {file_name_id=2 function_name_id=2 line=9 end_line=9 column=1 end_column=2}

StackFrames
1 {file_location_id=2 parent_frame_id=1}
2 {file_location_id=1 parent_frame_id=2}

%gemm_body (p0: bf16[8,16], p1: bf16[16,32]) -> bf16[8,32] {
  %p0 = bf16[8,16]{1,0} parameter(0)
  %p1 = bf16[16,32]{1,0} parameter(1)
  ROOT %d = bf16[8,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%add_body (q0: bf16[8,32], q1: bf16[8,32]) -> f32[8,32] {
  %q0 = bf16[8,32]{1,0} parameter(0)
  %q1 = bf16[8,32]{1,0} parameter(1)
  %a = bf16[8,32]{1,0} add(%q0, %q1)
  ROOT %c = f32[8,32]{1,0} convert(%a)
}

%stack_body (s0: f32[4,8,32], s1: f32[8,32], s2: s32[]) -> f32[4,8,32] {
  %s0 = f32[4,8,32]{2,1,0} parameter(0)
  %s1 = f32[8,32]{1,0} parameter(1)
  %b = f32[1,8,32]{2,1,0} bitcast(%s1)
  %s2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %u = f32[4,8,32]{2,1,0} dynamic-update-slice(%s0, %b, %s2, %z, %z)
}

%adam_body (r0: f32[8,32]) -> f32[8,32] {
  %r0 = f32[8,32]{1,0} parameter(0)
  ROOT %m = f32[8,32]{1,0} multiply(%r0, %r0)
}

%sum (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%cond (t: (s32[], f32[4,8,32], f32[8,32])) -> pred[] {
  %t = (s32[], f32[4,8,32]{2,1,0}, f32[8,32]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (t: (s32[], f32[4,8,32], f32[8,32])) -> (s32[], f32[4,8,32], f32[8,32]) {
  %t = (s32[], f32[4,8,32]{2,1,0}, f32[8,32]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %buf = f32[4,8,32]{2,1,0} get-tuple-element(%t), index=1
  %x = f32[8,32]{1,0} get-tuple-element(%t), index=2
  %upd = f32[4,8,32]{2,1,0} fusion(%buf, %x, %i), kind=kLoop, calls=%stack_body
  ROOT %out = (s32[], f32[4,8,32]{2,1,0}, f32[8,32]{1,0}) tuple(%i, %upd, %x)
}

ENTRY %main (a: bf16[8,16], w: bf16[16,32], r: bf16[8,32]) -> f32[4,8,32] {
  %a = bf16[8,16]{1,0} parameter(0)
  %w = bf16[16,32]{1,0} parameter(1)
  %r = bf16[8,32]{1,0} parameter(2)
  %mm = bf16[8,32]{1,0} fusion(%a, %w), kind=kCustom, calls=%gemm_body, metadata={op_name="jit(f)/dot_general"}
  %nrm = f32[8,32]{1,0} fusion(%mm, %r), kind=kLoop, calls=%add_body, metadata={op_name="jit(f)/add" stack_frame_id=2}
  %opt = f32[8,32]{1,0} fusion(%nrm), calls=%adam_body, metadata={op_name="jit(f)/cond/tree_bias_correction"}
  %zero = f32[] constant(0)
  %fill = f32[4,8,32]{2,1,0} broadcast(%zero), dimensions={}
  %i0 = s32[] constant(0)
  %init = (s32[], f32[4,8,32]{2,1,0}, f32[8,32]{1,0}) tuple(%i0, %fill, %opt)
  %loop = (s32[], f32[4,8,32], f32[8,32]) while(%init), condition=%cond, body=%body, backend_config={TRIP}
  %stacked = f32[4,8,32]{2,1,0} get-tuple-element(%loop), index=1
  %ar = f32[4,8,32]{2,1,0} all-reduce-start(%stacked), replica_groups=[1,4]<=[4], to_apply=%sum
  %ard = f32[4,8,32]{2,1,0} all-reduce-done(%ar)
  ROOT %cp = f32[4,8,32]{2,1,0} copy(%ard)
}
""".replace("TRIP", '"known_trip_count":{"n":"3"}')


def test_kernels_flops_bytes_and_kinds_by_hand():
    # peaks: 1e3 FLOP/s and 1e3 bytes/s; a collective's wire time: its operand bytes / 1e6
    found = roofline(HLO, 1e3, 1e3, link_seconds=lambda opcode, group, operand: operand / 1e6)
    kinds = found.by_kind()
    # GEMM: 2 x 8 x 32 x 16 FLOPs; reads 8x16 + 16x32 bf16, writes 8x32 bf16
    assert (kinds["gemm"]["flops"], kinds["gemm"]["bytes"]) == (8192, 256 + 1024 + 512)
    # the add + convert, its stack frame's innermost function rms_norm: reads two bf16[8,32], writes f32[8,32]
    assert kinds["norm/elementwise"]["bytes"] == 512 + 512 + 1024
    # named by its op_name (no stack frame): optax's bias correction
    assert kinds["optimizer"]["bytes"] == 1024 + 1024
    # data movement: the fill (a 4-byte scalar in, f32[4,8,32] out), three in-place updates of the stacked buffer
    # (each reads the f32[8,32] update and the s32 index and writes the update, never the whole buffer), the copy
    assert kinds["cast/copy"]["runs"] == 1 + 3 + 1
    assert kinds["cast/copy"]["bytes"] == (4 + 4096) + 3 * (1024 + 4 + 1024) + (4096 + 4096)
    # the all-reduce: async, so its 4096 / 1e6 s is hidden, not in the step
    collective = kinds["collective"]
    assert (collective["runs"], collective["seconds"]) == (1, 0)
    assert collective["hidden_seconds"] == pytest.approx(4096 / 1e6)
    # time: the GEMM compute-bound (8.192 s > 1.792 s), everything else memory-bound at 1e3 bytes/s
    by_hand = 8.192 + (2048 + 2048 + (4100 + 3 * 2052 + 8192)) / 1e3
    other = kinds["other"]["seconds"]  # the loop condition's compare (s32 and s32 in, pred out), counted once
    assert other == pytest.approx(9 / 1e3)
    assert found.step_seconds() == pytest.approx(by_hand + other)
    report = found.report(model_flops=8192)
    assert report["mfu"] == pytest.approx(8.192 / report["step_seconds"])
    assert "gemm" in kind_table(report) and "predicted step" in kind_table(report)
