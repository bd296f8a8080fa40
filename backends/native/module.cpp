// Python bindings (nanobind) of the native engine: backends._native.
//
// The BLAS comes from SciPy: backends/native_backend.py hands over the `sgemm`/`dgemm`
// capsules of scipy.linalg.cython_blas, and the library behind them is found among the
// loaded objects so that its own thread pool can be pinned to one thread (the engine
// splits work with OpenMP and calls the BLAS from every thread).
#include <dlfcn.h>
#include <link.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "fma_peak.hpp"
#include "rnn.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace rnn {

BlasApi& blas() {
    static BlasApi api;
    return api;
}

namespace {

int collect_object(struct dl_phdr_info* info, std::size_t, void* data) {
    if (info->dlpi_name && std::strstr(info->dlpi_name, "blas"))
        static_cast<std::vector<std::string>*>(data)->push_back(info->dlpi_name);
    return 0;
}

// The BLAS thread controls, from a loaded library: SciPy's wheels carry OpenBLAS with a
// `scipy_` prefix (NumPy's ILP64 copy uses a `64_` suffix and is not the one behind the
// capsules); a SciPy built against a system OpenBLAS exports the plain names.
void find_thread_controls(BlasApi& api) {
    std::vector<std::string> names;
    dl_iterate_phdr(collect_object, &names);
    const char* prefixes[] = {"scipy_openblas_", "openblas_"};
    for (const char* prefix : prefixes) {
        for (const std::string& name : names) {
            void* h = dlopen(name.c_str(), RTLD_LAZY | RTLD_NOLOAD);
            if (!h) continue;
            auto set = dlsym(h, (std::string(prefix) + "set_num_threads").c_str());
            auto get = dlsym(h, (std::string(prefix) + "get_num_threads").c_str());
            auto cfg = dlsym(h, (std::string(prefix) + "get_config").c_str());
            if (set && get) {
                api.set_num_threads = reinterpret_cast<void (*)(int)>(set);
                api.get_num_threads = reinterpret_cast<int (*)()>(get);
                Dl_info where;  // dlsym searches dependencies too: name the object that has it
                api.library = dladdr(set, &where) && where.dli_fname ? where.dli_fname : name;
                if (cfg) api.config = reinterpret_cast<const char* (*)()>(cfg)();
                for (const char* core : {"SkylakeX", "Cooperlake", "SapphireRapids"})
                    if (api.config.find(core) != std::string::npos) api.few_row_routes = true;
                return;  // the handle stays open: the library is loaded for good anyway
            }
            dlclose(h);
        }
    }
}

void* capsule_pointer(nb::handle cap) {
    PyObject* o = cap.ptr();
    if (!PyCapsule_CheckExact(o)) throw nb::type_error("expected a PyCapsule holding a BLAS function");
    void* p = PyCapsule_GetPointer(o, PyCapsule_GetName(o));
    if (!p) throw nb::python_error();
    return p;
}

void init_blas(nb::handle sgemm, nb::handle dgemm, nb::handle sgemv, nb::handle dgemv) {
    BlasApi& api = blas();
    api.sgemm = reinterpret_cast<sgemm_t>(capsule_pointer(sgemm));
    api.dgemm = reinterpret_cast<dgemm_t>(capsule_pointer(dgemm));
    api.sgemv = sgemv.is_none() ? nullptr : reinterpret_cast<sgemv_t>(capsule_pointer(sgemv));
    api.dgemv = dgemv.is_none() ? nullptr : reinterpret_cast<dgemv_t>(capsule_pointer(dgemv));
    if (!api.set_num_threads) find_thread_controls(api);
}

int set_blas_threads(int n) {
    BlasApi& api = blas();
    if (!api.set_num_threads) return -1;
    int before = api.get_num_threads();
    api.set_num_threads(n);
    return before;
}

// Lets tests and measurements compare the few-row GEMM routes with plain calls.
bool set_few_row_routes(bool on) {
    BlasApi& api = blas();
    const bool before = api.few_row_routes;
    api.few_row_routes = on;
    return before;
}

nb::dict blas_info() {
    BlasApi& api = blas();
    nb::dict d;
    d["ready"] = api.sgemm != nullptr && api.dgemm != nullptr;
    d["library"] = api.library;
    d["config"] = api.config;
    d["threads"] = api.get_num_threads ? api.get_num_threads() : -1;
    d["few_row_routes"] = api.few_row_routes;
    d["gemv"] = api.sgemv != nullptr && api.dgemv != nullptr;
    return d;
}

nb::dict build_info() {
    nb::dict d;
#if defined(__clang__)
    d["compiler"] = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
    d["compiler"] = std::string("gcc ") + __VERSION__;
#else
    d["compiler"] = "unknown";
#endif
#ifdef RNN_CXX_FLAGS
    d["flags"] = RNN_CXX_FLAGS;
#endif
    d["openmp"] = (int)_OPENMP;
    d["omp_max_threads"] = omp_get_max_threads();
#if defined(__AVX512F__)
    d["simd"] = "avx512";
#elif defined(__AVX2__)
    d["simd"] = "avx2";
#else
    d["simd"] = "baseline";
#endif
    return d;
}

Config make_config(nb::dict s) {
    Config c;
    auto str = [&](const char* k) { return nb::cast<std::string>(s[k]); };
    const std::string kind = str("kind"), act = str("activation"), head = str("head"), out = str("output_act"),
                      mode = str("bptt");
    if (kind == "elman") c.kind = Kind::Elman;
    else if (kind == "lstm") c.kind = Kind::Lstm;
    else if (kind == "gru") c.kind = Kind::Gru;
    else throw nb::value_error(("unknown model kind " + kind).c_str());
    if (act == "tanh") c.act = Act::Tanh;
    else if (act == "relu") c.act = Act::Relu;
    else if (act == "sigmoid") c.act = Act::Sigmoid;
    else throw nb::value_error(("unknown activation " + act).c_str());
    if (head == "softmax_xent") c.head = Head::Softmax;
    else if (head == "mse") c.head = Head::Mse;
    else throw nb::value_error(("unknown head " + head).c_str());
    c.out_tanh = out == "tanh";
    if (mode == "full") c.bptt = Bptt::Full;
    else if (mode == "truncated") c.bptt = Bptt::Truncated;
    else if (mode == "tail") c.bptt = Bptt::Tail;
    else throw nb::value_error(("unknown bptt mode " + mode).c_str());
    c.hidden = nb::cast<int>(s["hidden"]);
    c.layers = nb::cast<int>(s["layers"]);
    c.bias = nb::cast<bool>(s["bias"]);
    c.peephole = nb::cast<bool>(s["peephole"]);
    if (s.contains("reset_after")) c.reset_after = nb::cast<bool>(s["reset_after"]);
    if (s.contains("bidirectional")) c.bidirectional = nb::cast<bool>(s["bidirectional"]);
    c.k = nb::cast<int>(s["k"]);
    c.clip = nb::cast<double>(s["clip"]);
    c.input_size = nb::cast<int>(s["input_size"]);
    c.output_size = nb::cast<int>(s["output_size"]);
    c.tokens = nb::cast<bool>(s["tokens"]);
    if (s.contains("split_scale")) c.split_scale = nb::cast<double>(s["split_scale"]);
    if (s.contains("adapt_threads")) c.adapt = nb::cast<bool>(s["adapt_threads"]);
    if (s.contains("bf16")) c.bf16 = nb::cast<bool>(s["bf16"]);
    if (s.contains("recurrence")) {
        const std::string r = str("recurrence");
        if (r == "auto") c.recurrence = 0;
        else if (r == "batch") c.recurrence = 1;
        else if (r == "hidden") c.recurrence = 2;
        else throw nb::value_error(("unknown recurrence split " + r + " (auto, batch, hidden)").c_str());
    }
    if (c.hidden < 1 || c.layers < 1 || c.input_size < 1 || c.output_size < 1)
        throw nb::value_error("sizes must be positive");
    if ((c.bptt != Bptt::Full) && c.k < 1) throw nb::value_error("bptt K must be positive");
    if (c.bidirectional && c.bptt != Bptt::Full) throw nb::value_error("bidirectional layers need bptt full");
    if (c.peephole && c.kind != Kind::Lstm) throw nb::value_error("peepholes exist only for the lstm");
    return c;
}

using Array = nb::ndarray<nb::device::cpu, nb::c_contig>;

template <class T>
class PyNet {
  public:
    PyNet(nb::dict spec, const std::string& variant, int threads, int chunk, std::vector<Array> params) {
        Variant v = Variant::Default;
        if (variant == "sync") v = Variant::Sync;
        else if (variant == "async") v = Variant::Async;
        else if (variant != "default") throw nb::value_error(("unknown variant " + variant).c_str());
        if (!blas().sgemm) throw std::runtime_error("BLAS not initialised: call init_blas first");
        const Config cfg = make_config(spec);
        if (cfg.bf16 && !std::is_same_v<T, float>)
            throw nb::value_error("bfloat16 mixed precision keeps float32 masters: use Net32");
        net_ = std::make_unique<Net<T>>(cfg, v, threads, chunk);
        const Layout& lay = net_->layout();
        if (params.size() != lay.tensors.size())
            throw nb::value_error(("expected " + std::to_string(lay.tensors.size()) + " parameter arrays").c_str());
        for (std::size_t i = 0; i < params.size(); ++i) {
            const Tensor& t = lay.tensors[i];
            const Array& a = params[i];
            if (a.dtype() != nb::dtype<T>() || a.size() != t.size())
                throw nb::value_error(("parameter " + t.name + " has the wrong dtype or size").c_str());
            std::memcpy(net_->params() + t.offset, a.data(), sizeof(T) * t.size());
        }
    }

    std::vector<std::string> names() const {
        std::vector<std::string> out;
        for (const Tensor& t : net_->layout().tensors) out.push_back(t.name);
        return out;
    }

    void reserve(int Tn, int Bn) { net_->reserve(Tn, Bn); }

    nb::object forward(Array x) {
        Batch<T> in = batch(x, nullptr);
        const std::size_t O = net_->config().output_size, n = (std::size_t)in.T_ * in.B * O;
        T* out = new T[n];
        nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<T*>(p); });
        {
            nb::gil_scoped_release release;
            net_->forward(in, out);
        }
        std::size_t shape[3] = {(std::size_t)in.T_, (std::size_t)in.B, O};
        return nb::cast(nb::ndarray<nb::numpy, T>(out, 3, shape, owner));
    }

    nb::tuple loss_and_grads(Array x, Array y) {
        Batch<T> in = batch(x, &y);
        const Layout& lay = net_->layout();
        Buf<T> flat(lay.total);
        double loss;
        {
            nb::gil_scoped_release release;
            loss = net_->loss_and_grads(in, flat.data());
        }
        return nb::make_tuple(loss, unpack(flat.data()));
    }

    double sgd_step(Array x, Array y, double lr) {
        Batch<T> in = batch(x, &y);
        nb::gil_scoped_release release;
        return net_->sgd_step(in, (T)lr);
    }

    nb::list get_params() { return unpack(net_->params()); }

    void set_profiling(bool on) { net_->set_profiling(on); }

    // The counters since profiling was switched on: seconds per phase and thread (time in
    // the phase, of it waiting at barriers, CPU time in it), and per thread the wall and CPU seconds of
    // its team runs; None while profiling is off.
    nb::object profile() {
        const Profile* p = net_->profile();
        if (!p) return nb::none();
        nb::dict out, phases;
        out["steps"] = p->steps;
        for (int ph = 0; ph < kPhases; ++ph) {
            std::vector<double> in, wait, cpu;
            for (const ThreadProfile& t : p->threads) {
                in.push_back(t.phase_ns[ph] * 1e-9);
                wait.push_back(t.wait_ns[ph] * 1e-9);
                cpu.push_back(t.phase_cpu_ns[ph] * 1e-9);
            }
            nb::dict d;
            d["seconds"] = in;
            d["wait_seconds"] = wait;
            d["cpu_seconds"] = cpu;
            phases[phase_name(ph)] = d;
        }
        out["phases"] = phases;
        std::vector<double> wall, cpu;
        std::vector<std::int64_t> barriers, runs;
        for (const ThreadProfile& t : p->threads) {
            wall.push_back(t.wall_ns * 1e-9);
            cpu.push_back(t.cpu_ns * 1e-9);
            barriers.push_back(t.barriers);
            runs.push_back(t.runs);
        }
        out["wall_seconds"] = wall;
        out["cpu_seconds"] = cpu;
        out["barriers"] = barriers;
        out["runs"] = runs;
        nb::dict sizes;
        for (int b = 0, lo = 1; b < 8; ++b, lo *= 2)
            if (p->team_sizes[b]) sizes[nb::int_(lo)] = p->team_sizes[b];
        out["team_sizes"] = sizes;  // team runs by size bin: 1, 2, 3-4 (key 4), 5-8 (key 8), ...
        return out;
    }

  private:
    std::unique_ptr<Net<T>> net_;

    nb::list unpack(const T* flat) {
        nb::list out;
        for (const Tensor& t : net_->layout().tensors) {
            T* data = new T[t.size()];
            std::memcpy(data, flat + t.offset, sizeof(T) * t.size());
            nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<T*>(p); });
            std::size_t shape[2] = {(std::size_t)t.rows, (std::size_t)t.cols};
            const bool vec = t.name.rfind("b", 0) == 0 || t.name.rfind("p_", 0) == 0;
            out.append(vec ? nb::ndarray<nb::numpy, T>(data, 1, shape + 1, owner)
                           : nb::ndarray<nb::numpy, T>(data, 2, shape, owner));
        }
        return out;
    }

    // Checks shapes, dtypes and index ranges (an out-of-range token must not read
    // outside W_xh) and wraps the arrays without copying.
    Batch<T> batch(const Array& x, const Array* y) {
        const Config& c = net_->config();
        Batch<T> in;
        if (c.tokens) {
            if (x.dtype() != nb::dtype<std::int64_t>() || x.ndim() != 2)
                throw nb::value_error("token input x must be an int64 array of shape (T, B)");
            in.tok = static_cast<const std::int64_t*>(x.data());
            for (std::size_t i = 0; i < x.size(); ++i)
                if (in.tok[i] < 0 || in.tok[i] >= c.input_size)
                    throw nb::index_error("token id out of range of the input vocabulary");
        } else {
            if (x.dtype() != nb::dtype<T>() || x.ndim() != 3 || (int)x.shape(2) != c.input_size)
                throw nb::value_error("dense input x must be (T, B, input_size) in the model's dtype");
            in.x = static_cast<const T*>(x.data());
        }
        in.T_ = (int)x.shape(0);
        in.B = (int)x.shape(1);
        if (in.T_ < 1 || in.B < 1) throw nb::value_error("x must have T >= 1 and B >= 1");
        if (y) {
            if ((int)y->shape(0) != in.T_ || (int)y->shape(1) != in.B)
                throw nb::value_error("y must have the same (T, B) as x");
            if (c.head == Head::Softmax) {
                if (y->dtype() != nb::dtype<std::int64_t>() || y->ndim() != 2)
                    throw nb::value_error("softmax targets y must be an int64 array of shape (T, B)");
                in.lab = static_cast<const std::int64_t*>(y->data());
                for (std::size_t i = 0; i < y->size(); ++i)
                    if (in.lab[i] < 0 || in.lab[i] >= c.output_size)
                        throw nb::index_error("class id out of range of the output size");
            } else {
                if (y->dtype() != nb::dtype<T>() || y->ndim() != 3 || (int)y->shape(2) != c.output_size)
                    throw nb::value_error("mse targets y must be (T, B, output_size) in the model's dtype");
                in.y = static_cast<const T*>(y->data());
            }
        }
        return in;
    }
};

// The team sizes a TeamTuner picks for a run of calls whose cost at call i would be
// team_ns[i] on the whole team and solo_ns[i] on one thread (its behaviour under a given
// load, for tests).
std::vector<int> tuner_trace(int threads, const std::vector<double>& team_ns, const std::vector<double>& solo_ns) {
    if (team_ns.size() != solo_ns.size()) throw nb::value_error("team_ns and solo_ns differ in length");
    TeamTuner tuner;
    std::vector<int> out;
    for (std::size_t i = 0; i < team_ns.size(); ++i) {
        const int n = tuner.pick(threads, 1, 1);
        tuner.record(n, (std::int64_t)(n > 1 ? team_ns[i] : solo_ns[i]));
        out.push_back(n);
    }
    return out;
}

using Matrix = nb::ndarray<float, nb::ndim<2>, nb::device::cpu>;

// Row stride of a float32 matrix whose rows are contiguous (a C-ordered array or a slice of one).
int row_stride(const Matrix& a, const char* what) {
    if (a.shape(0) == 0 || a.shape(1) == 0) return (int)std::max<std::size_t>(a.shape(1), 1);  // nothing is read
    if (a.shape(1) > 1 && a.stride(1) != 1)
        throw nb::value_error((std::string(what) + " must have contiguous rows (unit column stride)").c_str());
    if (a.shape(0) > 1 && a.stride(0) < (std::int64_t)a.shape(1))
        throw nb::value_error((std::string(what) + " rows overlap").c_str());
    return (int)std::max<std::int64_t>(a.shape(0) > 1 ? a.stride(0) : (std::int64_t)a.shape(1), 1);
}

// c = alpha op(a) op(b) + beta c in place, by the engine's float32 product (the BLAS, gemm<float>)
// or its bfloat16 one; `threads` > 1 splits the columns of c among OpenMP threads as the engine's
// panels do (each thread one single-threaded call). For tests and measurements.
//
// `recurrent`: the product as a recurrence's per-step product runs it, `repeat` times over
// (c accumulates when beta is 1): op(b) stays the same throughout and is packed once by each
// thread (the engine's own float32 kernel where one is active, else the BLAS with op(b)
// taken as cache-resident; bfloat16 keeps its packing likewise).
void py_gemm(Matrix a, Matrix b, Matrix c, bool ta, bool tb, float alpha, float beta, const std::string& precision,
             int threads, bool recurrent, int repeat) {
    const int M = (int)c.shape(0), N = (int)c.shape(1);
    const int K = (int)(ta ? a.shape(0) : a.shape(1));
    if ((int)(ta ? a.shape(1) : a.shape(0)) != M || (int)(tb ? b.shape(1) : b.shape(0)) != K ||
        (int)(tb ? b.shape(0) : b.shape(1)) != N)
        throw nb::value_error("gemm: shapes of op(a) (M x K), op(b) (K x N) and c (M x N) disagree");
    const int lda = row_stride(a, "a"), ldb = row_stride(b, "b"), ldc = row_stride(c, "c");
    const bool low = precision == "bfloat16";
    if (!low && precision != "float32") throw nb::value_error("gemm: precision is float32 or bfloat16");
    if (!low && !blas().sgemm) throw std::runtime_error("BLAS not initialised: call init_blas first");
    const float *A = a.data(), *B = b.data();
    float* C = c.data();
    nb::gil_scoped_release release;
    if (repeat < 1) throw nb::value_error("gemm: repeat must be at least 1");
    if (repeat > 1 && !recurrent) throw nb::value_error("gemm: repeat is for recurrent products");
    auto part = [&](int c0, int c1) {
        if (c0 >= c1) return;
        const float* Bc = tb ? B + (std::size_t)c0 * ldb : B + c0;
        bf16::ReuseScope reuse(recurrent && low);
        f32::ReuseScope reuse32(recurrent && !low);
        for (int r = 0; r < repeat; ++r) {
            if (low)
                bf16::gemm(ta, tb, M, c1 - c0, K, alpha, A, lda, Bc, ldb, beta, C + c0, ldc);
            else if (recurrent && !ta && f32::active())
                f32::gemm(tb, M, c1 - c0, K, alpha, A, lda, Bc, ldb, beta, C + c0, ldc);
            else
                gemm(ta, tb, M, c1 - c0, K, alpha, A, lda, Bc, ldb, beta, C + c0, ldc, recurrent);
        }
    };
    if (threads <= 1) {
        part(0, N);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        const int n = omp_get_num_threads(), id = omp_get_thread_num();
        int per = (N + n - 1) / n;
        per = (per + bf16::NR - 1) / bf16::NR * bf16::NR;
        part(std::min(N, id * per), std::min(N, (id + 1) * per));
    }
}

// x rounded to bfloat16 (nearest, ties to even) and widened back to float32, as the GEMM packs it.
nb::object round_bf16(nb::ndarray<const float, nb::c_contig, nb::device::cpu> x) {
    const std::size_t n = x.size();
    float* out = new float[n ? n : 1];
    nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<float*>(p); });
    for (std::size_t i = 0; i < n; ++i) out[i] = bf16::widen(bf16::round(x.data()[i]));
    std::vector<std::size_t> shape(x.ndim());
    for (std::size_t d = 0; d < x.ndim(); ++d) shape[d] = x.shape(d);
    return nb::cast(nb::ndarray<nb::numpy, float>(out, x.ndim(), shape.data(), owner));
}

std::string set_bf16_kernel(const std::string& name) {
    const std::string before = bf16::kernel_name();
    if (name != "auto" && name != "portable" && name != "avx512bf16" && name != "amx")
        throw nb::value_error(("unknown bfloat16 kernel " + name + " (auto, amx, avx512bf16, portable)").c_str());
    if (!bf16::set_kernel(name)) {
        if (name == "amx" && !amx::available()) throw nb::value_error(amx::why_not());
        throw nb::value_error("this CPU has no AVX512-BF16 (vdpbf16ps)");
    }
    return before;
}

std::string set_f32_kernel(const std::string& name) {
    const std::string before = f32::kernel_name();
    if (name != "auto" && name != "avx512" && name != "avx2" && name != "blas")
        throw nb::value_error(("unknown float32 kernel " + name + " (auto, avx512, avx2, blas)").c_str());
    if (!f32::set_kernel(name)) throw nb::value_error(("this CPU cannot run the " + name + " kernel").c_str());
    return before;
}

// GFLOP/s of the core's widest multiply-add (fma_peak.hpp) on `threads` threads, the best of
// repeated runs over `seconds`; 0 where the CPU has no kernel for the precision.
nb::dict fma_peak(const std::string& precision, int threads, double seconds, const std::string& unit) {
    if (precision != "float32" && precision != "bfloat16")
        throw nb::value_error("fma_peak: precision is float32 or bfloat16");
    if (unit != "auto" && unit != "avx512bf16" && unit != "amx")
        throw nb::value_error("fma_peak: unit is auto, avx512bf16 or amx");
    nb::dict d;
    const std::string k = peak::kernel(precision, nullptr, unit);
    d["kernel"] = k;
    double best = 0.0;
    if (!k.empty()) {
        nb::gil_scoped_release release;
        std::int64_t iters = 1 << 16;
        const auto t0 = std::chrono::steady_clock::now();
        while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < seconds) {
            const auto s0 = std::chrono::steady_clock::now();
            best = std::max(best, peak::rate(precision, iters, threads, unit));
            const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - s0).count();
            if (took < 0.02) iters *= 2;  // runs of at least 20 ms: the fork and the clock are noise
        }
    }
    d["gflops"] = best;
    return d;
}

template <class T>
void bind_net(nb::module_& m, const char* name) {
    nb::class_<PyNet<T>>(m, name)
        .def(nb::init<nb::dict, const std::string&, int, int, std::vector<Array>>(), "spec"_a, "variant"_a,
             "threads"_a, "chunk"_a, "params"_a)
        .def("names", &PyNet<T>::names)
        .def("reserve", &PyNet<T>::reserve, "T"_a, "B"_a)
        .def("forward", &PyNet<T>::forward, "x"_a)
        .def("loss_and_grads", &PyNet<T>::loss_and_grads, "x"_a, "y"_a)
        .def("sgd_step", &PyNet<T>::sgd_step, "x"_a, "y"_a, "lr"_a)
        .def("get_params", &PyNet<T>::get_params)
        .def("set_profiling", &PyNet<T>::set_profiling, "on"_a)
        .def("profile", &PyNet<T>::profile);
}

}  // namespace
}  // namespace rnn

NB_MODULE(_native, m) {
    m.doc() = "The native C++ RNN engine of rnn-harness (OpenMP + a BLAS handed in from SciPy).";
    m.def("init_blas", &rnn::init_blas, "sgemm"_a, "dgemm"_a, "sgemv"_a = nb::none(), "dgemv"_a = nb::none());
    m.def("set_blas_threads", &rnn::set_blas_threads, "n"_a);
    m.def("blas_info", &rnn::blas_info);
    m.def("set_few_row_routes", &rnn::set_few_row_routes, "on"_a);
    m.def("build_info", &rnn::build_info);
    // calls of one kind and shape the thread tuner spends timing a team against one thread
    m.attr("tuner_probe_calls") = 2 * rnn::TeamTuner::kProbe * rnn::TeamTuner::kBurst;
    m.def("tuner_trace", &rnn::tuner_trace, "threads"_a, "team_ns"_a, "solo_ns"_a);
    // the bfloat16 GEMM: whether the CPU has VDPBF16PS, whether this process may run AMX tiles
    // ("" where it may, else why not), which kernel runs ("amx", "avx512bf16" or "portable",
    // the emulation), and a switch ("auto", "amx", "avx512bf16", "portable")
    m.def("bf16_cpu", &rnn::bf16::cpu_has_avx512bf16);
    m.def("amx_why_not", [] { return std::string(rnn::amx::why_not()); });
    m.def("bf16_kernel", [] { return std::string(rnn::bf16::kernel_name()); });
    m.def("set_bf16_kernel", &rnn::set_bf16_kernel, "name"_a);
    m.def("round_bf16", &rnn::round_bf16, "x"_a);
    m.def("gemm", &rnn::py_gemm, "a"_a, "b"_a, "c"_a, "ta"_a = false, "tb"_a = false, "alpha"_a = 1.0f,
          "beta"_a = 0.0f, "precision"_a = "float32", "threads"_a = 1, "recurrent"_a = false, "repeat"_a = 1);
    // the engine's own float32 kernel of the recurrent products: which one runs ("avx512",
    // "avx2", or "blas": none, the BLAS) and a switch ("auto", "avx512", "avx2", "blas")
    m.def("f32_kernel", [] { return std::string(rnn::f32::kernel_name()); });
    // the batch sizes whose per-step products take that kernel (the others: the BLAS)
    m.attr("f32_own_rows") = nb::make_tuple(rnn::kOwnMinRows, rnn::kOwnMaxRows);
    m.def("set_f32_kernel", &rnn::set_f32_kernel, "name"_a);
    // unit (bfloat16): "auto" the best this process can run (AMX, else VDPBF16PS), or one of them
    m.def("fma_peak", &rnn::fma_peak, "precision"_a, "threads"_a = 1, "seconds"_a = 0.3, "unit"_a = "auto");
    rnn::bind_net<float>(m, "Net32");
    rnn::bind_net<double>(m, "Net64");
}
