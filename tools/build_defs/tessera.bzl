"""One place for Tessera's compiler flags and rule wrappers.

Every BUILD file uses ts_cc_library / ts_cc_test / ts_cc_binary instead of the native rules,
so warnings, OpenMP and the CUDA switch are decided here once.
"""

TS_COPTS = [
    "-Wall",
    "-Wextra",
    "-Wno-unused-parameter",
    "-Wno-sign-compare",
    # GCC 12 reports false positives inside its own AVX-512 intrinsics headers (via Eigen).
    "-Wno-maybe-uninitialized",
    "-fopenmp",
]

TS_LINKOPTS = ["-fopenmp"]

# The CUDA toolkit (also the path of @cuda in WORKSPACE). nvcc runs from here rather than
# through the repository's symlink: it finds cicc, ptxas and its headers relative to its
# own location, which a sandbox holding only declared inputs would not contain.
CUDA_PATH = "/usr/local/cuda"

def ts_cc_library(name, copts = [], linkopts = [], **kwargs):
    native.cc_library(
        name = name,
        copts = TS_COPTS + copts,
        linkopts = TS_LINKOPTS + linkopts,
        **kwargs
    )

def ts_cc_binary(name, copts = [], linkopts = [], **kwargs):
    native.cc_binary(
        name = name,
        copts = TS_COPTS + copts,
        linkopts = TS_LINKOPTS + linkopts,
        **kwargs
    )

def ts_cc_test(name, copts = [], linkopts = [], deps = [], size = "small", **kwargs):
    """A doctest suite; tests/main.cc provides main(). Small (60 s) unless said otherwise."""
    native.cc_test(
        name = name,
        size = size,
        copts = TS_COPTS + copts,
        linkopts = TS_LINKOPTS + linkopts,
        deps = deps + ["//tests:doctest_main"],
        **kwargs
    )

def ts_fuzz_target(name, srcs, deps = [], corpus = None, size = "small"):
    """A libFuzzer target and the replay test of its corpus.

    `name`: the fuzzer, built only by tools/fuzz/run.sh (--config=fuzz: clang with
    -fsanitize=fuzzer,address,undefined), so it is tagged manual. `name + "_replay_test"`:
    the same LLVMFuzzerTestOneInput run once on every file of corpus/<corpus> (seeds from
    real files) and regressions/<corpus> (every crash ever found), built like any test, so
    `bazel test //...` and the sanitizer build check them on every run.
    """
    corpus = corpus or name.replace("_fuzzer", "")
    native.cc_binary(
        name = name,
        srcs = srcs,
        copts = TS_COPTS,
        linkopts = TS_LINKOPTS + ["-fsanitize=fuzzer"],
        deps = deps,
        tags = ["manual"],
    )
    native.cc_test(
        name = name + "_replay_test",
        size = size,
        srcs = srcs,
        copts = TS_COPTS,
        linkopts = TS_LINKOPTS,
        deps = deps + ["//tools/fuzz:replay_main"],
        args = [
            "tools/fuzz/corpus/" + corpus,
            "tools/fuzz/regressions/" + corpus,
        ],
        data = native.glob(["corpus/%s/**" % corpus, "regressions/%s/**" % corpus]),
    )

def ts_cuda_library(name, srcs, hdrs = [], extra_hdrs = [], deps = [], nvcc_flags = [], tags = [], **kwargs):
    """Compiles .cu files with the toolkit's nvcc into objects wrapped in a cc_library.

    Bazel 4 has no CUDA rules, so each .cu becomes a genrule producing a position-independent
    object, which cc_library accepts as a source. Include paths: the workspace root and the
    CUDA headers; headers of `hdrs` and `deps` must be reachable from the workspace root.
    """
    objs = []
    for src in srcs:
        base = src.replace(".cu", "")
        out = "_cuda_objs/%s/%s.pic.o" % (name, base)
        native.genrule(
            name = "%s_%s_nvcc" % (name, base.replace("/", "_")),
            srcs = [src] + hdrs + extra_hdrs,
            outs = [out],
            tags = tags,
            cmd = (CUDA_PATH + "/bin/nvcc -c -std=c++20 -O3 --expt-relaxed-constexpr " +
                   "-Xcompiler -fPIC -I. -I$(GENDIR) " +
                   "-gencode arch=compute_90,code=sm_90 " +
                   "-gencode arch=compute_90,code=compute_90 " +
                   " ".join(nvcc_flags) +
                   " $(location %s) -o $@" % src),
        )
        objs.append(out)
    native.cc_library(
        name = name,
        srcs = objs,
        hdrs = hdrs,
        deps = deps + ["@cuda//:cudart"],
        tags = tags,
        **kwargs
    )

def _ts_link_only_impl(ctx):
    return [CcInfo(linking_context = ctx.attr.dep[CcInfo].linking_context)]

ts_link_only = rule(
    implementation = _ts_link_only_impl,
    attrs = {"dep": attr.label(providers = [CcInfo], mandatory = True)},
    doc = """A cc library's objects and link flags without its headers.

    Dependents link the library but do not compile against it: under --config=cuda, the
    CUDA backend's and the toolkit's headers would otherwise become inputs of every compile
    action above //tensor, and the CUDA build would recompile the whole tree instead of
    reusing the CPU build's objects (the two configurations share one output tree).""",
)
