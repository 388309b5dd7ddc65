from setuptools import find_packages, setup

setup(
    name="kiln",
    version="0.1.0",
    description="A deep-learning compiler for PyTorch models: graph IR, passes, loop IR, native backends",
    packages=find_packages(include=["kiln", "kiln.*"]),
    package_data={"kiln.passes.ordering": ["policy.npz"]},
    python_requires=">=3.10",
    install_requires=[
        # Any recent torch works; CI installs the CPU build (torch==2.13.0) before kiln.
        "torch>=2.4",
        "numpy>=1.24",
        "networkx>=3.0",
        "scipy>=1.10",
        "ml_dtypes>=0.3",
    ],
    extras_require={
        "loops": ["islpy>=2023.1"],
        "test": ["pytest>=7", "hypothesis>=6", "transformers>=4.40", "islpy>=2023.1",
                 # pytest.ini runs the suite on two worker processes
                 "pytest-xdist>=3.5",
                 # PyTorch's op database (torch.testing._internal) imports it
                 "expecttest",
                 # pass-ordering tests; small pure-Python packages (torch is already required)
                 "gymnasium>=1.0", "stable-baselines3>=2.3", "sb3-contrib>=2.3",
                 # the schedule autotuner's cost model (gradient-boosted trees)
                 "lightgbm>=4",
                 # the benchmark harness's smoke test checks its PNG plot
                 "matplotlib",
                 # the triton backend's tests (Triton's interpreter on the CPU; wheels: linux x86_64)
                 "triton==3.9.0; platform_system == 'Linux' and platform_machine == 'x86_64'",
                 # the tvm backend's tests (see the "tvm" extra)
                 "apache-tvm==0.27.*", "apache-tvm-ffi==0.1.14.post1", "psutil",
                 # the JAX frontend's tests
                 "jax>=0.10,<0.13",
                 # kiln.export's tests (serving inside DuckDB)
                 "duckdb>=2.0", "pyarrow"],
        # apache-tvm-ffi 0.1.15 crashes in tvm.ir.save_json, which MetaSchedule's database calls
        "jax": ["jax>=0.10,<0.13"],
        "export": ["duckdb>=2.0", "pyarrow"],
        "tvm": ["apache-tvm==0.27.*", "apache-tvm-ffi==0.1.14.post1", "psutil"],
        "rl": ["gymnasium>=1.0", "stable-baselines3>=2.3", "sb3-contrib>=2.3", "tqdm", "rich"],
        "bench": ["onnxruntime", "onnx", "onnxscript", "matplotlib", "tqdm"],
    },
    entry_points={
        "torch_dynamo_backends": ["kiln = kiln.frontends.torch.dynamo:kiln_backend"],
        "console_scripts": ["kiln-demo = kiln.compiler.demo:main", "kiln = kiln.compiler.cli:main"],
    },
)
