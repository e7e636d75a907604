"""No hidden global state: importing fsdp_jax or calling its functions
installs no process-wide hook; the launcher's worker entry point does, and
runs the script exactly as ``python SCRIPT`` would."""

import subprocess
import sys
import textwrap

from tests.helpers import REPO, subprocess_env


def _run(code, *args, cwd=REPO):
  return subprocess.run([sys.executable, *args] if not code else
                        [sys.executable, "-c", textwrap.dedent(code)],
                        capture_output=True, text=True, timeout=120, cwd=cwd,
                        env=subprocess_env(JAX_PLATFORMS="cpu"))


def test_import_and_library_calls_install_no_hook():
  out = _run("""
      import atexit, sys, signal, threading
      registered = []  # (module of each exit handler registered from now on)
      real_register = atexit.register
      atexit.register = lambda fn, *a, **k: (
          registered.append(str(getattr(fn, "__module__", "?"))), real_register(fn, *a, **k))[1]
      sigterm = signal.getsignal(signal.SIGTERM)
      import jax
      import fsdp_jax, jax.numpy as jnp, optax
      info = fsdp_jax.distributed.initialize()  # one process: no job to join
      mesh = fsdp_jax.make_mesh(shard=1, devices=jax.devices()[:1])
      state = fsdp_jax.init_train_state(params={"w": jnp.ones(3)},
          optimizer=optax.sgd(0.1), mesh=mesh, config=fsdp_jax.FSDPConfig())
      step = fsdp_jax.shard_train_step(lambda p, b: jnp.sum(p["w"] * b), optax.sgd(0.1))
      state, _ = step(state, jnp.ones((1, 3)))
      ckpt = fsdp_jax.CheckpointManager(sys.argv[1] if len(sys.argv) > 1 else "/tmp/unused")
      fsdp_jax.distributed.shutdown()
      ours = [m for m in registered if m.startswith("fsdp_jax")]
      assert not ours, ours
      assert sys.excepthook is sys.__excepthook__, sys.excepthook
      assert signal.getsignal(signal.SIGTERM) == sigterm
      fsdp_jax.distributed.install_failure_hooks()
      fsdp_jax.distributed.install_failure_hooks()  # twice: installs once
      assert sys.excepthook is not sys.__excepthook__
      ours = [m for m in registered if m.startswith("fsdp_jax")]
      assert ours == ["fsdp_jax._src.runtime.distributed"], ours
      print("ok")
  """)
  assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_worker_entry_point_runs_a_script_like_python(tmp_path):
  script = tmp_path / "train.py"
  script.write_text(textwrap.dedent("""
      import sys
      print("argv", sys.argv)
      print("name", __name__)
      print("path0", sys.path[0])
      print("hooked", sys.excepthook is not sys.__excepthook__)
      sys.exit(3)
  """))
  out = _run(None, "-m", "fsdp_jax._src.runtime.worker", str(script), "--lr", "1e-3")
  assert out.returncode == 3, out.stderr[-3000:]
  assert f"argv [{str(script)!r}, '--lr', '1e-3']" in out.stdout
  assert "name __main__" in out.stdout
  assert f"path0 {tmp_path}" in out.stdout
  assert "hooked True" in out.stdout


def test_worker_entry_point_runs_a_module(tmp_path):
  (tmp_path / "mytrain.py").write_text("import sys\nprint('argv', sys.argv[1:], __name__)\n")
  out = _run(None, "-m", "fsdp_jax._src.runtime.worker", "-m", "mytrain", "x", cwd=tmp_path)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "argv ['x'] __main__" in out.stdout


def test_worker_entry_point_usage_error():
  out = _run(None, "-m", "fsdp_jax._src.runtime.worker")
  assert out.returncode != 0 and "usage: python -m fsdp_jax._src.runtime.worker" in out.stderr
