"""Graph capture and replay (``ts.graph.capture`` / ``launch`` / ``record_call``),
``ts.jit(capture_graph=...)`` and ``ts.stream``."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tessera_jax as ts
from tests._util import RTOL, assert_close, f64, rand


def _np_block(x, w, b):
    """The float64 reference of the captured block's results."""
    h = x @ w
    a = np.maximum(h, 0.0)
    e = np.exp(a - a.max(axis=1, keepdims=True))
    s = e / e.sum(axis=1, keepdims=True)
    return h, a, s, s @ b, (s @ b).sum(axis=1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_replay_matches_eager_and_new_inputs_by_name(dtype):
    x, w, b = rand((8, 16), dtype), rand((16, 32), dtype, scale=0.3), rand((32, 4), dtype)
    with ts.graph.capture(x=x, w=w) as g:
        h = ts.matmul(x, w)
        a = ts.relu(h)
        s = ts.softmax(a, axis=1)
        m = ts.matmul(s, b)
        y = ts.sum(m, axis=1)
    eager = (h, a, s, m, y)
    assert g.ops == ["ts_matmul", "ts_relu", "ts_softmax", "ts_matmul", "ts_sum"]
    assert list(g.inputs) == ["x", "w", "in2"] and g.inputs["in2"] is b
    out = ts.graph.launch(g)
    assert len(out) == 5
    ref = _np_block(f64(x), f64(w), f64(b))
    for o, e, r in zip(out, eager, ref):
        assert o.dtype == e.dtype and o.shape == e.shape
        assert_close(o, f64(e), dtype, factor=2)
        assert_close(o, r, dtype, factor=4)

    # New values by name; the rest keep their captured values; no retrace.
    x2, b2 = rand((8, 16), dtype), rand((32, 4), dtype)
    out2 = ts.graph.launch(g, x=x2, in2=np.asarray(b2))
    out3 = ts.graph.launch(g, x=x2)
    assert_close(out2[4], _np_block(f64(x2), f64(w), f64(b2))[4], dtype, factor=4)
    assert_close(out3[4], _np_block(f64(x2), f64(w), f64(b))[4], dtype, factor=4)
    assert g.trace_count == 1
    assert g.compiler_options == {}  # no command buffers on CPUs


def test_graph_text_multi_results_and_record_call():
    x, y = rand((4, 8)), rand((4, 8))

    def saxpy(a, b, *, alpha):  # a "kernel launch" that binds a ts operator internally
        return ts.relu(a) * alpha + b, a - b

    with ts.graph.capture() as g:
        p, q = ts.graph.record_call("saxpy", saxpy, x, y, alpha=2.5)
        z = ts.exp(q)
    assert g.ops == ["saxpy", "ts_exp"]  # the relu inside saxpy belongs to its step
    text = repr(g)
    assert "%0 = saxpy(in0, in1) -> float32[4, 8], float32[4, 8]" in text
    assert "%1 = ts_exp(%0.1) -> float32[4, 8]" in text
    (p2, q2), z2 = ts.graph.launch(g, in1=2 * y)
    assert_close(q2, f64(x) - 2 * f64(y))
    xn, yn = f64(x), 2 * f64(y)
    assert_close(p2, np.maximum(xn, 0) * 2.5 + yn)
    assert_close(z2, np.exp(xn - yn))
    (p3, _), z3 = ts.graph.launch(g)
    np.testing.assert_allclose(np.asarray(p3), np.asarray(p), rtol=RTOL[np.dtype(np.float32)])
    np.testing.assert_allclose(np.asarray(z3), np.asarray(z), rtol=RTOL[np.dtype(np.float32)])
    assert g.trace_count == 1
    g.set_outputs(z, p)  # only these, in this order: the program is compiled again
    z4, p4 = ts.graph.launch(g, in0=2 * x)
    assert_close(z4, np.exp(2 * f64(x) - f64(y)))
    assert_close(p4, np.maximum(2 * f64(x), 0) * 2.5 + f64(y))
    assert g.trace_count == 2
    with pytest.raises(ValueError, match=r"set_outputs: result 0 \(a ArrayImpl\) is not an"):
        g.set_outputs(x)
    # Outside a capture, record_call is the call itself.
    np.testing.assert_array_equal(ts.graph.record_call("saxpy", saxpy, x, y, alpha=1.0)[1], x - y)


def test_non_ts_operations_inside_the_block_are_errors():
    x = rand((4, 8))
    with pytest.raises(ValueError, match=r"operand 0 of ts_exp \(a float32\[4, 8\] array\) was"):
        with ts.graph.capture():
            ts.exp(ts.relu(x) + 1.0)  # jnp's add made the operand
    with pytest.raises(ValueError, match=r"operand 0 of ts_relu .* not a ts operator"):
        with ts.graph.capture():
            ts.relu(jax.jit(jnp.sin)(x))
    with pytest.raises(ValueError, match=r"operand 0 of ts_relu .*before the `with"):
        with ts.graph.capture():
            ts.relu(np.ones((2, 2), np.float32))  # converted to a jax array inside the block
    with pytest.raises(TypeError, match=r"operand 0 of saxpy is a ndarray, not a jax array"):
        with ts.graph.capture():
            ts.graph.record_call("saxpy", lambda a: a, np.ones(3, np.float32))
    # A refused step records nothing, not even its valid operands as inputs.
    a, b = rand((8, 8)), rand((8, 8))
    with ts.graph.capture() as g:
        with pytest.raises(ValueError, match=r"operand 1 of ts_matmul"):
            ts.matmul(b, ts.relu(a) + 1.0)
        ts.matmul(a, a)  # one array passed twice is one input
    assert g.ops == ["ts_relu", "ts_matmul"] and list(g.inputs) == ["in0"]
    assert g.inputs["in0"] is a
    # Operators traced inside the block (under jit) are not recorded.
    with ts.graph.capture() as g:
        jax.jit(ts.relu)(x)
    assert g.ops == []


def test_capture_records_its_own_thread_only():
    x = rand((4, 8))
    with ts.graph.capture() as g:
        other = threading.Thread(target=lambda: ts.relu(x))
        other.start()
        other.join()
        ts.exp(x)
    assert g.ops == ["ts_exp"]


def test_capture_and_launch_errors():
    x = rand((4, 8))
    with pytest.raises(RuntimeError, match=r"ts.graph.capture: cannot capture under a trace"):
        jax.jit(lambda a: ts.graph.capture().__enter__())(x)
    with pytest.raises(RuntimeError, match=r"already running on this thread"):
        with ts.graph.capture(), ts.graph.capture():
            pass
    with pytest.raises(ValueError, match=r"input\(s\) 'w' were named but no recorded"):
        with ts.graph.capture(x=x, w=rand((8, 8))):
            ts.relu(x)
    with pytest.raises(TypeError, match=r"input w=ndarray must be a jax array"):
        ts.graph.capture(w=np.ones(3)).__enter__()
    with pytest.raises(TypeError, match=r"command_buffer='yes' must be a bool"):
        ts.graph.capture(command_buffer="yes").__enter__()

    with ts.graph.capture(x=x) as g:
        with pytest.raises(RuntimeError, match=r"still being captured"):
            ts.graph.launch(g)
        ts.tanh(x)
    with pytest.raises(ValueError, match=r"unknown input name\(s\) 'y'; the graph's inputs are x"):
        ts.graph.launch(g, y=x)
    with pytest.raises(ValueError, match=r"input 'x' must be float32\[4, 8\] as captured, got "):
        ts.graph.launch(g, x=rand((8, 4)))
    with pytest.raises(ValueError, match=r"got bfloat16\[4, 8\]"):
        ts.graph.launch(g, x=x.astype(jnp.bfloat16))
    with pytest.raises(TypeError, match=r"input 'x' is a str; expected an array"):
        ts.graph.launch(g, x="x")
    with pytest.raises(RuntimeError, match=r"cannot launch a graph under a trace"):
        jax.jit(lambda a: ts.graph.launch(g, x=a))(x)
    with pytest.raises(TypeError, match=r"graph=list must be a CapturedGraph"):
        ts.graph.launch([])
    with ts.graph.capture() as empty:
        pass
    with pytest.raises(ValueError, match=r"the graph is empty"):
        ts.graph.launch(empty)
    x.delete()  # the captured input is gone: launching needs a value for it
    with pytest.raises(ValueError, match=r"input 'x' was deleted .* pass x=<a float32\[4, 8\]"):
        ts.graph.launch(g)
    x2 = rand((4, 8))
    assert_close(ts.graph.launch(g, x=x2)[0], np.tanh(f64(x2)))


def test_jit_capture_graph():
    opts = ts.graph.command_buffer_options(True)
    assert opts == {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN"}
    assert ts.graph.command_buffer_options(False) == {"xla_gpu_enable_command_buffer": ""}
    with pytest.raises(TypeError, match=r"command_buffer_options: enabled=1 must be a bool"):
        ts.graph.command_buffer_options(1)
    x = rand((8, 8))
    ref = np.maximum(f64(x) @ f64(x), 0)
    for flag in (True, False):

        @ts.jit(capture_graph=flag)
        def step(a):
            return ts.relu(ts.matmul(a, a))

        assert_close(step(x), ref)
    assert_close(ts.jit(lambda a: ts.relu(ts.matmul(a, a)), capture_graph=True)(x), ref)
    with pytest.raises(TypeError, match=r"ts.jit: capture_graph=1 must be a bool or None"):
        ts.jit(lambda a: a, capture_graph=1)
    with pytest.raises(ValueError, match=r"capture_graph=True contradicts compiler_options"):
        ts.jit(
            lambda a: a,
            capture_graph=True,
            compiler_options={"xla_gpu_enable_command_buffer": ""},
        )


def test_jit_deterministic():
    x = rand((8, 8))
    ref = np.maximum(f64(x) @ f64(x), 0)
    for flag in (True, False):
        f = ts.jit(lambda a: ts.relu(ts.matmul(a, a)), deterministic=flag, capture_graph=True)
        assert_close(f(x), ref)
    with pytest.raises(TypeError, match=r"ts.jit: deterministic='yes' must be a bool or None"):
        ts.jit(lambda a: a, deterministic="yes")
    with pytest.raises(ValueError, match=r"deterministic=True contradicts compiler_options"):
        ts.jit(lambda a: a, deterministic=True, compiler_options={"xla_gpu_deterministic_ops": 0})


def test_streams():
    devs = jax.devices()
    s = ts.stream.new(priority=0)
    assert s.device == devs[0] and s.priority == 0
    host = np.array(rand((16,)))
    expected = host.copy()
    dst = jax.device_put(np.zeros(16, np.float32), devs[0])
    out = ts.stream.memcpy_async(dst=dst, src=host, stream=s)
    host[:] = -1.0  # a later write to the source does not reach the copy
    s.synchronize()
    np.testing.assert_array_equal(np.asarray(out), expected)
    np.testing.assert_array_equal(np.asarray(dst), 0.0)  # dst itself is unchanged
    # Device to device, and within a device: a new buffer, placed like dst.
    s1 = ts.stream.new(device=devs[1])
    moved = ts.stream.memcpy_async(dst=devs[1], src=out, stream=s1)
    same = ts.stream.memcpy_async(dst=out, src=out)
    assert moved.sharding.device_set == {devs[1]}
    assert same.unsafe_buffer_pointer() != out.unsafe_buffer_pointer()
    ts.stream.synchronize()
    np.testing.assert_array_equal(np.asarray(moved), expected)
    np.testing.assert_array_equal(np.asarray(same), expected)

    with pytest.raises(ValueError, match=r"ts.stream.new: priority=-1 is not available"):
        ts.stream.new(priority=-1)
    with pytest.raises(TypeError, match=r"ts.stream.new: priority=True must be an int"):
        ts.stream.new(priority=True)
    with pytest.raises(TypeError, match=r"device='gpu0' must be a jax.Device"):
        ts.stream.new(device="gpu0")
    with pytest.raises(ValueError, match=r"stream belongs to .* but the destination is on"):
        ts.stream.memcpy_async(dst=devs[2], src=host, stream=s)
    with pytest.raises(ValueError, match=r"dst is float32\[8\] but src is float32\[16\]"):
        ts.stream.memcpy_async(dst=jnp.zeros(8, jnp.float32), src=host)
    with pytest.raises(ValueError, match=r"dst is int32\[16\] but src is float32\[16\]"):
        ts.stream.memcpy_async(dst=jnp.zeros(16, jnp.int32), src=host)
    with pytest.raises(TypeError, match=r"src=list must be a NumPy or jax array"):
        ts.stream.memcpy_async(dst=dst, src=[1.0])
    with pytest.raises(TypeError, match=r"dst=str must be a jax array, a jax.Device"):
        ts.stream.memcpy_async(dst="gpu", src=host)
    with pytest.raises(TypeError, match=r"stream=3 must come from ts.stream.new"):
        ts.stream.memcpy_async(dst=dst, src=host, stream=3)
    with pytest.raises(TypeError, match=r"synchronize: stream='s' must come from"):
        ts.stream.synchronize("s")


@ts.kernel
def _axpy(a, X, Y, Out: ts.mut):
    i = ts.launch.thread_id()
    m = i < X.shape[0]
    ts.tile.store(Out, i, a * ts.tile.load(X, i, mask=m) + ts.tile.load(Y, i, mask=m), mask=m)


def test_kernel_launches_are_captured_and_replayed():
    n = 300  # not a multiple of the 128 threads: the masked tail replays too
    x, y, out = rand((n,)), rand((n,)), rand((n,))
    launch = ts.launch.grid(blocks=(ts.ceil_div(n, 128),), threads=(128,))(_axpy)
    with ts.graph.capture(x=x) as g:
        z = launch(2.0, x, y, out)
        r = ts.relu(z)
    assert g.ops == ["ts.launch:_axpy", "ts_relu"]
    x2 = rand((n,))
    got_z, got_r = ts.graph.launch(g, x=x2)
    want = 2.0 * f64(x2) + f64(y)
    assert_close(got_z, want)
    assert_close(got_r, np.maximum(want, 0.0))
    assert_close(z, 2.0 * f64(x) + f64(y))
    assert_close(r, np.maximum(2.0 * f64(x) + f64(y), 0.0))
