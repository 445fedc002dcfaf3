#include "coordinator/step_cost.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace colibri {
namespace {

constexpr size_t kTerms = 3;  // fixed, per row, per thousand keys
constexpr int kRounds = 8;    // reweighted fits
using Vec = std::array<double, kTerms>;
using Mat = std::array<Vec, kTerms>;

Vec terms(const StepShape& s) {
  return {1.0, double(s.rows()), s.attended * 1e-3};
}

int octave(int rows) {
  int o = 0;
  while (rows > 1 && o + 1 < StepCostModel::kOctaves) {
    rows >>= 1;
    ++o;
  }
  return o;
}

// Solves a x = b over the active terms (the others 0) by Gaussian elimination with partial
// pivoting; a pivot that vanishes leaves its term 0.
Vec solve(const Mat& a, const Vec& b, const std::array<bool, kTerms>& active) {
  std::array<size_t, kTerms> idx{};
  size_t n = 0;
  for (size_t t = 0; t < kTerms; ++t)
    if (active[t]) idx[n++] = t;
  Mat m{};
  Vec v{};
  for (size_t i = 0; i < n; ++i) {
    for (size_t j = 0; j < n; ++j) m[i][j] = a[idx[i]][idx[j]];
    v[i] = b[idx[i]];
  }
  const auto vanishes = [](double pivot) { return std::abs(pivot) < 1e-300; };
  for (size_t c = 0; c < n; ++c) {
    size_t p = c;
    for (size_t r = c + 1; r < n; ++r)
      if (std::abs(m[r][c]) > std::abs(m[p][c])) p = r;
    std::swap(m[c], m[p]);
    std::swap(v[c], v[p]);
    if (vanishes(m[c][c])) continue;
    for (size_t r = c + 1; r < n; ++r) {
      const double f = m[r][c] / m[c][c];
      for (size_t k = c; k < n; ++k) m[r][k] -= f * m[c][k];
      v[r] -= f * v[c];
    }
  }
  Vec y{};
  for (size_t r = n; r-- > 0;) {
    double s = v[r];
    for (size_t k = r + 1; k < n; ++k) s -= m[r][k] * y[k];
    y[r] = vanishes(m[r][r]) ? 0 : s / m[r][r];
  }
  Vec x{};
  for (size_t i = 0; i < n; ++i) x[idx[i]] = y[i];
  return x;
}

}  // namespace

double attended_keys(int64_t position, int64_t rows) {
  return double(rows) * double(position) + double(rows) * double(rows + 1) / 2;
}

int StepCostModel::observations() const {
  int n = 0;
  for (const auto& o : kept_) n += int(o.size());
  return n;
}

int StepCostModel::largest_rows() const {
  int most = 0;
  for (const auto& o : kept_)
    for (const Point& p : o) most = std::max(most, p.shape.rows());
  return most;
}

void StepCostModel::observe(const StepShape& shape, double seconds) {
  if (shape.rows() < 1 || !(seconds >= 0) || !std::isfinite(seconds)) return;
  std::deque<Point>& o = kept_[size_t(octave(shape.rows()))];
  o.push_back({shape, seconds});
  if (int(o.size()) > kPerOctave) o.pop_front();
  stale_ = true;
}

const StepCostFit& StepCostModel::fit() const {
  if (stale_) refit();
  return fit_;
}

void StepCostModel::refit() const {
  stale_ = false;
  std::vector<Vec> x;
  std::vector<double> y;
  std::vector<StepShape> points;
  for (const auto& o : kept_)
    for (const Point& p : o) {
      x.push_back(terms(p.shape));
      y.push_back(p.seconds);
      points.push_back(p.shape);
    }
  const size_t n = x.size();
  // Each term scaled to at most 1 over the data, so that one tiny ridge suits all three: it
  // settles terms the data cannot tell apart (every call of one size) without moving the fit.
  Vec scale{};
  for (const Vec& v : x)
    for (size_t t = 0; t < kTerms; ++t) scale[t] = std::max(scale[t], v[t]);
  for (double& s : scale) s = s > 0 ? s : 1;
  for (Vec& v : x)
    for (size_t t = 0; t < kTerms; ++t) v[t] /= scale[t];

  // Relative errors count: a call's time is stretched in proportion (noise, a slower core), and
  // a decode call's error matters as much as a chunk's. Each call weighs 1 / seconds^2 times its
  // robust weight: Huber's for three rounds, then Tukey's biweight, which gives a call stretched
  // far beyond the others none at all, however many rows it had.
  std::vector<double> base(n), w(n, 1.0), relative(n), sorted(n);
  for (size_t i = 0; i < n; ++i) base[i] = 1 / std::max(y[i] * y[i], 1e-14);
  Vec coef{};
  for (int round = 0;; ++round) {
    Mat a{};
    Vec b{};
    for (size_t i = 0; i < n; ++i)
      for (size_t r = 0; r < kTerms; ++r) {
        b[r] += base[i] * w[i] * x[i][r] * y[i];
        for (size_t c = 0; c < kTerms; ++c) a[r][c] += base[i] * w[i] * x[i][r] * x[i][c];
      }
    for (size_t t = 0; t < kTerms; ++t) a[t][t] *= 1 + 1e-9;
    // Non-negative: the most negative term leaves, and the rest is solved again.
    std::array<bool, kTerms> active{true, true, true};
    for (size_t pass = 0; pass < kTerms; ++pass) {
      coef = solve(a, b, active);
      size_t worst = kTerms;  // none
      for (size_t t = 0; t < kTerms; ++t)
        if (active[t] && coef[t] < 0 && (worst == kTerms || coef[t] < coef[worst])) worst = t;
      if (worst == kTerms) break;
      active[worst] = false;
      coef[worst] = 0;
    }
    for (size_t i = 0; i < n; ++i) {
      double predicted = 0;
      for (size_t t = 0; t < kTerms; ++t) predicted += coef[t] * x[i][t];
      relative[i] = std::abs(y[i] - predicted) * std::sqrt(base[i]);
    }
    if (round == kRounds || n < 4) break;
    // The scale of the relative errors: 1.4826 times their median, at least 0.1 %.
    sorted = relative;
    std::nth_element(sorted.begin(), sorted.begin() + std::ptrdiff_t(n / 2), sorted.end());
    const double scale_r = std::max(1.4826 * sorted[n / 2], 1e-3);
    for (size_t i = 0; i < n; ++i) {
      if (round < 3) {
        const double k = 1.345 * scale_r;
        w[i] = relative[i] <= k ? 1.0 : k / relative[i];
      } else {
        const double u = relative[i] / (4.685 * scale_r);
        w[i] = u < 1 ? (1 - u * u) * (1 - u * u) : 0.0;
      }
    }
  }
  fit_ = {coef[0] / scale[0], coef[1] / scale[1], coef[2] / scale[2]};
  double sum = 0;
  for (size_t i = 0; i < n; ++i) sum += std::abs(y[i] - fit_.predict(points[i]));
  mean_abs_error_s_ = n ? sum / double(n) : 0;
}

ChunkChoice choose_prompt_rows(const StepCostModel& model, const StepShape& decode,
                               std::span<const PromptWork> prompts, int budget, double bound_s,
                               int min_rows) {
  int64_t waiting = 0;
  for (const PromptWork& p : prompts) waiting += std::max<int64_t>(0, p.remaining);
  const int want = int(std::min<int64_t>(std::max(budget, 0), waiting));
  // The call with the first `rows` prompt rows added to `decode`.
  const auto with = [&](int rows) {
    StepShape s = decode;
    s.prompt_rows = rows;
    int64_t left = rows;
    for (const PromptWork& p : prompts) {
      const int64_t take = std::min(left, std::max<int64_t>(0, p.remaining));
      s.attended += attended_keys(p.position, take);
      left -= take;
      if (left == 0) break;
    }
    return s;
  };
  ChunkChoice choice;
  if (bound_s <= 0 || decode.decode_rows == 0 || want == 0) {
    choice.prompt_rows = want;
  } else {
    const int floor_rows = std::min(std::max(min_rows, 1), want);
    const int explored = 2 * model.largest_rows() - decode.rows();
    int lo = 0, hi = std::min(want, std::max(floor_rows, explored));
    // The predicted time grows with the rows (non-negative terms): the most rows within the bound.
    while (lo < hi) {
      const int mid = lo + (hi - lo + 1) / 2;
      if (model.predict(with(mid)) <= bound_s)
        lo = mid;
      else
        hi = mid - 1;
    }
    choice.prompt_rows = std::max(lo, floor_rows);
    choice.cut = choice.prompt_rows < want;
  }
  choice.predicted_s = model.predict(with(choice.prompt_rows));
  return choice;
}

}  // namespace colibri
