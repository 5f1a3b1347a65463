// CPU twin of the fused distillation-loss kernels (kernels/kd_*.py): the same four primitives,
// the same maths, parallel over token rows with at::parallel_for. Python shim:
// kernels/cpu_backend.py; orchestration and TP collectives: kernels/fused_kd.py.
//
//   row_stats(z, t?, inv_t)                 -> [N, 6] (m_s, l_s, m_u, l_u, a, b) of this shard
//   jsd_sums(z, t, lse, inv_t, beta)        -> [N, 2] (JSD loss part, KL(q||m) part)
//   write_grad(z, t?, out, lse, coef, inv_t, beta, code)   out may alias z (in-place gradient)
//   sparse_scatter(out, ids, s, d, lse, coef)               g[n, ids] = c0 exp(s - lse_s) + d
// See the Python kernels' docstrings for the formulas. Rows are walked twice while they sit in
// the core's cache (max, then sums), so no online rescaling is needed here.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// exp that the compiler vectorises (std::exp does not without -ffast-math): Cephes range
// reduction + degree-6 polynomial, ~1 ulp in float32 on the range used; exp(x < -87.3) = 0.
inline float fast_exp(float x) {
  const float xc = std::min(std::max(x, -87.3f), 88.7f);
  const float fx = std::floor(xc * 1.44269504088896341f + 0.5f);
  float r = xc - fx * 0.693359375f;
  r = r + fx * 2.12194440e-4f;
  const float r2 = r * r;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r2 + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(fx) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.3f ? 0.0f : y * scale;
}

template <typename T>
inline float ld(const T* p, int64_t j, float inv_t) {
  return static_cast<float>(p[j]) * inv_t;
}

template <typename T>
float row_max(const T* x, int64_t v, float inv_t) {
  float m = -1e30f;
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < v; ++j) m = std::max(m, ld(x, j, inv_t));
  return m;
}

// Sums run in float32 SIMD lanes over chunks of kChunk entries and are carried across chunks in
// double: a plain float32 running sum over 150K entries loses ~1e-5 relative.
constexpr int64_t kChunk = 512;

template <typename T>
void row_stats_row(const T* z, const T* t, int64_t v, float inv_t, float* out) {
  const float m_s = row_max(z, v, inv_t);
  const float m_u = t ? row_max(t, v, inv_t) : 0.f;
  double l_s = 0, l_u = 0, a = 0, b = 0;
  for (int64_t lo = 0; lo < v; lo += kChunk) {
    const int64_t hi = std::min(v, lo + kChunk);
    float cl_s = 0.f, cl_u = 0.f, ca = 0.f, cb = 0.f;
    if (t == nullptr) {
#pragma omp simd reduction(+ : cl_s)
      for (int64_t j = lo; j < hi; ++j) cl_s += fast_exp(ld(z, j, inv_t) - m_s);
    } else {
#pragma omp simd reduction(+ : cl_s, cl_u, ca, cb)
      for (int64_t j = lo; j < hi; ++j) {
        const float s = ld(z, j, inv_t), u = ld(t, j, inv_t);
        const float e_s = fast_exp(s - m_s), e_u = fast_exp(u - m_u);
        cl_s += e_s;
        cl_u += e_u;
        ca += e_u > 0.f ? e_u * (u - s) : 0.f;   // e == 0 guards 0 * inf for -inf logits
        cb += e_s > 0.f ? e_s * (s - u) : 0.f;
      }
    }
    l_s += cl_s; l_u += cl_u; a += ca; b += cb;
  }
  out[0] = m_s; out[1] = static_cast<float>(l_s); out[2] = m_u; out[3] = static_cast<float>(l_u);
  out[4] = static_cast<float>(a); out[5] = static_cast<float>(b);
}

// log that the compiler vectorises, for positive normal floats (the argument here is in [1, 2]):
// Cephes logf -- exponent and mantissa by bit masks, mantissa moved to [sqrt(1/2), sqrt(2)),
// degree-8 polynomial; ~1 ulp in float32.
inline float fast_log(float x) {
  int32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  float e = static_cast<float>(((bits >> 23) & 0xff) - 126);
  bits = (bits & 0x807fffff) | 0x3f000000;  // mantissa in [0.5, 1)
  float m;
  std::memcpy(&m, &bits, sizeof(m));
  const bool low = m < 0.707106781186547524f;
  e = low ? e - 1.f : e;
  m = low ? m + m - 1.f : m - 1.f;
  const float z = m * m;
  float y = 7.0376836292e-2f;
  y = y * m - 1.1514610310e-1f;
  y = y * m + 1.1676998740e-1f;
  y = y * m - 1.2420140846e-1f;
  y = y * m + 1.4249322787e-1f;
  y = y * m - 1.6668057665e-1f;
  y = y * m + 2.0000714765e-1f;
  y = y * m - 2.4999993993e-1f;
  y = y * m + 3.3333331174e-1f;
  y = y * m * z;
  y += -2.12194440e-4f * e - 0.5f * z;
  return m + y + 0.693359375f * e;
}

// log m = log(beta p + (1 - beta) q) from log p and log q, without leaving log space.
inline float log_mix(float log_p, float log_q, float log_beta, float log_1m_beta) {
  const float la = log_p + log_beta, lb = log_q + log_1m_beta;
  const float mx = std::max(la, lb);
  return mx + fast_log(fast_exp(la - mx) + fast_exp(lb - mx));
}

template <typename T>
void jsd_row(const T* z, const T* t, int64_t v, float inv_t, float lse_s, float lse_u, float beta,
             float* out) {
  const float log_beta = std::log(beta), log_1m_beta = std::log1p(-beta);
  double loss = 0, kqm = 0;
  for (int64_t lo = 0; lo < v; lo += kChunk) {
    const int64_t hi = std::min(v, lo + kChunk);
    float c_pm = 0.f, c_qm = 0.f;
#pragma omp simd reduction(+ : c_pm, c_qm)
    for (int64_t j = lo; j < hi; ++j) {
      const float log_q = ld(z, j, inv_t) - lse_s, log_p = ld(t, j, inv_t) - lse_u;
      const float q = fast_exp(log_q), p = fast_exp(log_p);
      const float log_m = log_mix(log_p, log_q, log_beta, log_1m_beta);
      c_pm += p > 0.f ? p * (log_p - log_m) : 0.f;
      c_qm += q > 0.f ? q * (log_q - log_m) : 0.f;
    }
    loss += beta * static_cast<double>(c_pm) + (1.0 - beta) * static_cast<double>(c_qm);
    kqm += c_qm;
  }
  out[0] = static_cast<float>(loss); out[1] = static_cast<float>(kqm);
}

// g[j] = value(j) over a row, through a stack buffer per chunk: `g` may alias the student row (the
// in-place gradient), so the compute loop writes only to memory that aliases nothing. Direct
// read-z/write-g loops measured 1.5-6x slower in some builds, depending on unrelated code.
template <typename T, typename F>
inline void store_row(T* g, int64_t v, F value) {
  float buf[kChunk];
  for (int64_t lo = 0; lo < v; lo += kChunk) {
    const int64_t n = std::min(kChunk, v - lo);
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) buf[j] = value(lo + j);
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) g[lo + j] = static_cast<T>(buf[j]);
  }
}

template <typename T>
void grad_row(const T* z, const T* t, T* g, int64_t v, float inv_t, float lse_s, float lse_u,
              float c0, float c1, float beta, int64_t code) {
  if (code == 0) {  // student term only (sparse support); never touches the (null) teacher row
    store_row(g, v, [&](int64_t j) { return c0 * fast_exp(ld(z, j, inv_t) - lse_s); });
  } else if (code == 1) {
    store_row(g, v, [&](int64_t j) {
      return c0 * (fast_exp(ld(z, j, inv_t) - lse_s) - fast_exp(ld(t, j, inv_t) - lse_u));
    });
  } else if (code == 2) {
    store_row(g, v, [&](int64_t j) {
      const float log_q = ld(z, j, inv_t) - lse_s, log_p = ld(t, j, inv_t) - lse_u;
      const float q = fast_exp(log_q);
      return q > 0.f ? c0 * q * (log_q - log_p - c1) : 0.f;
    });
  } else {
    const float log_beta = std::log(beta), log_1m_beta = std::log1p(-beta);
    store_row(g, v, [&](int64_t j) {
      const float log_q = ld(z, j, inv_t) - lse_s, log_p = ld(t, j, inv_t) - lse_u;
      const float q = fast_exp(log_q);
      const float log_m = log_mix(log_p, log_q, log_beta, log_1m_beta);
      return q > 0.f ? c0 * q * (log_q - log_m - c1) : 0.f;
    });
  }
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, ": expected a CPU tensor");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, ": expected [N, V] with unit stride over V");
}

const at::Tensor* teacher_or_null(const c10::optional<at::Tensor>& t, const at::Tensor& z) {
  if (!t.has_value()) return nullptr;
  check_rows(*t, "teacher");
  TORCH_CHECK(t->sizes() == z.sizes() && t->scalar_type() == z.scalar_type(),
              "teacher: expected the student's shape and dtype");
  return &t.value();
}

constexpr int64_t kGrain = 4;  // rows per task

}  // namespace

at::Tensor row_stats(const at::Tensor& z, const c10::optional<at::Tensor>& teacher, double inv_t) {
  check_rows(z, "student");
  const at::Tensor* t = teacher_or_null(teacher, z);
  const int64_t n = z.size(0), v = z.size(1);
  auto out = at::empty({n, 6}, z.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, z.scalar_type(), "row_stats", [&] {
    const scalar_t* zp = z.data_ptr<scalar_t>();
    const scalar_t* tp = t ? t->data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, n, kGrain, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r)
        row_stats_row(zp + r * z.stride(0), tp ? tp + r * t->stride(0) : nullptr, v,
                      static_cast<float>(inv_t), o + r * 6);
    });
  });
  return out;
}

at::Tensor jsd_sums(const at::Tensor& z, const at::Tensor& teacher, const at::Tensor& lse, double inv_t,
                    double beta) {
  check_rows(z, "student");
  check_rows(teacher, "teacher");
  TORCH_CHECK(teacher.sizes() == z.sizes() && teacher.scalar_type() == z.scalar_type(),
              "teacher: expected the student's shape and dtype");
  const at::Tensor* t = &teacher;
  const int64_t n = z.size(0), v = z.size(1);
  auto lse_c = lse.contiguous();
  const float* l = lse_c.data_ptr<float>();
  auto out = at::empty({n, 2}, z.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, z.scalar_type(), "jsd_sums", [&] {
    const scalar_t* zp = z.data_ptr<scalar_t>();
    const scalar_t* tp = t->data_ptr<scalar_t>();
    at::parallel_for(0, n, kGrain, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r)
        jsd_row(zp + r * z.stride(0), tp + r * t->stride(0), v, static_cast<float>(inv_t), l[2 * r],
                l[2 * r + 1], static_cast<float>(beta), o + 2 * r);
    });
  });
  return out;
}

void write_grad(const at::Tensor& z, const c10::optional<at::Tensor>& teacher, at::Tensor& out,
                const at::Tensor& lse, const at::Tensor& coef, double inv_t, double beta, int64_t code) {
  check_rows(z, "student");
  check_rows(out, "out");
  const at::Tensor* t = teacher_or_null(teacher, z);
  TORCH_CHECK(code == 0 || t != nullptr, "teacher: divergence code ", code, " needs the teacher logits");
  TORCH_CHECK(out.sizes() == z.sizes() && out.scalar_type() == z.scalar_type(), "out: expected the student's shape and dtype");
  const int64_t n = z.size(0), v = z.size(1);
  auto lse_c = lse.contiguous();
  auto coef_c = coef.contiguous();
  const float* l = lse_c.data_ptr<float>();
  const float* c = coef_c.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, z.scalar_type(), "write_grad", [&] {
    const scalar_t* zp = z.data_ptr<scalar_t>();
    const scalar_t* tp = t ? t->data_ptr<scalar_t>() : nullptr;
    scalar_t* gp = out.data_ptr<scalar_t>();
    at::parallel_for(0, n, kGrain, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r)
        grad_row(zp + r * z.stride(0), tp ? tp + r * t->stride(0) : nullptr, gp + r * out.stride(0), v,
                 static_cast<float>(inv_t), l[2 * r], l[2 * r + 1], c[2 * r], c[2 * r + 1],
                 static_cast<float>(beta), code);
    });
  });
}

void sparse_scatter(at::Tensor& out, const at::Tensor& ids, const at::Tensor& s, const at::Tensor& d,
                    const at::Tensor& lse, const at::Tensor& coef) {
  check_rows(out, "out");
  TORCH_CHECK(ids.is_contiguous() && ids.scalar_type() == at::kLong, "ids: expected contiguous int64 [N, K]");
  const int64_t n = out.size(0), v = out.size(1), k = ids.size(1);
  auto s_c = s.contiguous(), d_c = d.contiguous(), lse_c = lse.contiguous(), coef_c = coef.contiguous();
  const int64_t* ip = ids.data_ptr<int64_t>();
  const float *sp = s_c.data_ptr<float>(), *dp = d_c.data_ptr<float>();
  const float *l = lse_c.data_ptr<float>(), *c = coef_c.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "sparse_scatter", [&] {
    scalar_t* gp = out.data_ptr<scalar_t>();
    at::parallel_for(0, n, kGrain * 16, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        for (int64_t j = 0; j < k; ++j) {
          const int64_t id = ip[r * k + j];
          if (id < 0 || id >= v) continue;   // padding or another shard's id: touch nothing
          const float val = c[2 * r] * std::exp(sp[r * k + j] - l[2 * r]) + dp[r * k + j];
          gp[r * out.stride(0) + id] = static_cast<scalar_t>(val);
        }
      }
    });
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "CPU twin of the fused distillation-loss kernels (see kernels/cpu_backend.py)";
  m.def("row_stats", &row_stats, "per-row softmax statistics [N, 6] of a vocab shard");
  m.def("jsd_sums", &jsd_sums, "per-row JSD loss part and KL(q||m) part [N, 2]");
  m.def("write_grad", &write_grad, "gradient w.r.t. the student logits, into out (may alias the student)");
  m.def("sparse_scatter", &sparse_scatter, "support-set gradient entries, masked store");
}
