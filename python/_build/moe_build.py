"""A minimal PEP 517 build backend for moe-expert-service (standard library only).

Builds a pure-Python wheel of moe_expert_service/. If the environment variable
MOE_LIBMOE names a built libmoe.so at build time, that file is bundled as
moe_expert_service/libmoe.so (the package finds it there first). No network,
no setuptools: `pip install ./python` works offline.
"""
import base64
import hashlib
import io
import os
import tarfile
import zipfile

NAME = "moe_expert_service"
DIST = "moe_expert_service"
VERSION = "0.1.0"
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

METADATA = (
    "Metadata-Version: 2.1\n"
    "Name: moe-expert-service\n"
    f"Version: {VERSION}\n"
    "Summary: Disaggregated MoE experts (GPU cache + CPU expert servers) from PyTorch engines\n"
    "Requires-Python: >=3.8\n"
)
WHEEL = "Wheel-Version: 1.0\nGenerator: moe_build\nRoot-Is-Purelib: false\nTag: py3-none-any\n"


def _package_files():
    pkg = os.path.join(HERE, NAME)
    for name in sorted(os.listdir(pkg)):
        if name.endswith(".py"):
            yield f"{NAME}/{name}", os.path.join(pkg, name)
    lib = os.environ.get("MOE_LIBMOE")
    if lib:
        if not os.path.isfile(lib):
            raise FileNotFoundError(f"MOE_LIBMOE={lib}: no such file")
        yield f"{NAME}/libmoe.so", lib


def _record_line(arcname, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arcname},sha256={digest},{len(data)}"


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def get_requires_for_build_editable(config_settings=None):
    return []


def _write_wheel(wheel_directory, entries):
    filename = f"{DIST}-{VERSION}-py3-none-any.whl"
    dist_info = f"{DIST}-{VERSION}.dist-info"
    entries = list(entries) + [(f"{dist_info}/METADATA", METADATA.encode()), (f"{dist_info}/WHEEL", WHEEL.encode())]
    record = [_record_line(a, d) for a, d in entries] + [f"{dist_info}/RECORD,,"]
    with zipfile.ZipFile(os.path.join(wheel_directory, filename), "w", zipfile.ZIP_DEFLATED) as z:
        for arcname, data in entries:
            info = zipfile.ZipInfo(arcname, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = (0o755 if arcname.endswith(".so") else 0o644) << 16
            z.writestr(info, data)
        z.writestr(f"{dist_info}/RECORD", "\n".join(record) + "\n")
    return filename


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    entries = []
    for arcname, path in _package_files():
        with open(path, "rb") as f:
            entries.append((arcname, f.read()))
    return _write_wheel(wheel_directory, entries)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    # A .pth file that puts this source tree on sys.path.
    return _write_wheel(wheel_directory, [(f"{DIST}.pth", (HERE + "\n").encode())])


def build_sdist(sdist_directory, config_settings=None):
    base = f"{DIST}-{VERSION}"
    path = os.path.join(sdist_directory, base + ".tar.gz")
    with tarfile.open(path, "w:gz") as t:
        for rel in ["pyproject.toml", "README.md", "_build/moe_build.py"]:
            if os.path.exists(os.path.join(HERE, rel)):
                t.add(os.path.join(HERE, rel), arcname=f"{base}/{rel}")
        for arcname, p in _package_files():
            if not arcname.endswith(".so"):
                t.add(p, arcname=f"{base}/{arcname}")
        info = tarfile.TarInfo(f"{base}/PKG-INFO")
        data = METADATA.encode()
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
    return base + ".tar.gz"
