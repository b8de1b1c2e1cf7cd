"""The compiled counting core, an optional C extension (the rest of the build is in pyproject.toml).

Without a C compiler and Python's headers the extension is skipped (``optional=True``) and the
server runs the same rules in pure Python (``tally_server.domain.idmap``); ``tally serve`` logs
which one it runs, and ``tally_build_info`` carries it as its ``core`` label.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tally_server._ledgercore",
            sources=["src/tally_server/_ledgercore.c"],
            extra_compile_args=[
                "-O2",
                "-std=c11",
                "-Wall",
                "-Wextra",
                "-Wno-missing-field-initializers",
                "-Wno-unused-parameter",
            ],
            optional=True,
        )
    ]
)
