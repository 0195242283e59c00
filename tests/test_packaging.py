"""The package installs from a wheel (as on a cluster's worker nodes): every module is in it and the int8 kernel loads."""

import subprocess
import sys
import zipfile

import pytest
from launch_support import ENV, ROOT


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_wheel_holds_every_module_and_its_kernel_loads_when_installed(tmp_path):
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                            "-w", str(tmp_path / "dist"), "-q"], cwd=tmp_path, capture_output=True, text=True, timeout=560)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    wheel = next((tmp_path / "dist").glob("actorq_jax-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "actorq_jax").rglob("*.py")}
    assert modules - names == set(), f"modules missing from the wheel: {sorted(modules - names)}"
    assert any(n.startswith("actorq_jax/kernels/_int8_kernels") and n.endswith(".so") for n in names), sorted(names)

    site = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(site), str(wheel), "-q"],
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-3000:]
    code = ("import actorq_jax, actorq_jax.launch.actor, actorq_jax.launch.worker; from actorq_jax import kernels; "
            "assert kernels.kernel_available(), kernels.describe_kernel(); print(actorq_jax.__file__)")
    env = {**ENV, "PYTHONPATH": str(site)}
    # Run outside the repository, so the import can only come from the installed wheel.
    probe = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert probe.stdout.strip().startswith(str(site))
