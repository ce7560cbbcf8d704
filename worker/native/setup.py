# Built with MLX's own extension helper (CMake + nanobind); `make setup`
# installs it into the worker's environment without build isolation, so it
# compiles against the very mlx (and nanobind) installed there.
from mlx import extension
from setuptools import setup

setup(
    ext_modules=[extension.CMakeExtension("kvmux_native._ext")],
    cmdclass={"build_ext": extension.CMakeBuild},
    packages=["kvmux_native"],
    package_data={"kvmux_native": ["*.so"]},
    zip_safe=False,
)
