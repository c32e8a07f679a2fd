#include "draft_select.h"

#include <algorithm>
#include <cmath>
#include <queue>
#include <utility>

namespace verl_ext {

double acceptance_weight(double score, int64_t depth, const float* f, int m, int rows) {
  if (m <= 0) return 0.0;
  if (rows > 1) f += static_cast<int64_t>(std::min(depth_bucket(depth), rows - 1)) * m;
  if (m == 1) return f[0];
  const double s = std::min(1.0, std::max(0.0, score)) * (m - 1);
  const int i = std::min(static_cast<int>(s), m - 2);
  const double a = s - i;
  return (1.0 - a) * f[i] + a * f[i + 1];
}

namespace {

struct Item {
  double w;
  int64_t node;
  bool operator<(const Item& o) const {  // max-heap on weight; ties: smaller node id first
    return w < o.w || (w == o.w && node > o.node);
  }
};

// The search loop shared by chains and trees. `children(node, push)` pushes the node's
// children onto the queue.
template <typename Children>
SelectResult search(std::priority_queue<Item>& q, Children children, const double* t,
                    int64_t t_len, double base, int patience) {
  SelectResult r;
  if (t_len <= 0) return r;
  double al = base;
  double best = t[0] > 0 ? al / t[0] : 0.0;
  r.objective = best;
  r.al = al;
  double prev = best;
  int falls = 0;
  int64_t n = 0;
  while (!q.empty() && n + 1 < t_len) {
    const Item it = q.top();
    q.pop();
    r.order.push_back(static_cast<int32_t>(it.node));
    ++n;
    al += it.w;
    const double obj = t[n] > 0 ? al / t[n] : 0.0;
    ++r.evaluations;
    if (obj > best) {
      best = obj;
      r.n = n;
      r.objective = obj;
      r.al = al;
    }
    falls = obj < prev ? falls + 1 : 0;
    prev = obj;
    if (patience > 0 && falls >= patience) break;
    children(it.node);
  }
  return r;
}

}  // namespace

SelectResult select_chains(const float* scores, int64_t rows, int64_t width, const int32_t* lens,
                           const float* f, int m, int f_rows, const double* t, int64_t t_len,
                           double base, int patience) {
  std::priority_queue<Item> q;
  for (int64_t i = 0; i < rows; ++i)
    if (lens[i] > 0) q.push({acceptance_weight(scores[i * width], 0, f, m, f_rows), i * width});
  auto children = [&](int64_t node) {
    const int64_t i = node / width, j = node % width + 1;
    if (j < lens[i]) q.push({acceptance_weight(scores[i * width + j], j, f, m, f_rows), node + 1});
  };
  return search(q, children, t, t_len, base, patience);
}

SelectResult select_tree(const int32_t* parents, const float* scores, int64_t nodes,
                         const float* f, int m, int f_rows, const double* t, int64_t t_len,
                         double base, int patience) {
  std::vector<int64_t> first(nodes, -1), next(nodes, -1), depth(nodes, 0);  // child lists
  std::priority_queue<Item> q;
  for (int64_t u = nodes - 1; u >= 0; --u) {
    const int32_t p = parents[u];
    if (p < 0) {
      q.push({acceptance_weight(scores[u], 0, f, m, f_rows), u});
    } else {
      next[u] = first[p];
      first[p] = u;
    }
  }
  auto children = [&](int64_t node) {
    for (int64_t c = first[node]; c >= 0; c = next[c]) {
      depth[c] = depth[node] + 1;
      q.push({acceptance_weight(scores[c], depth[c], f, m, f_rows), c});
    }
  };
  return search(q, children, t, t_len, base, patience);
}

void isotonic_fit(const double* y, const double* w, int64_t n, double* out) {
  std::vector<double> val, wt;
  std::vector<int64_t> size;
  val.reserve(n);
  wt.reserve(n);
  size.reserve(n);
  for (int64_t i = 0; i < n; ++i) {
    val.push_back(y[i]);
    wt.push_back(w[i]);
    size.push_back(1);
    while (val.size() > 1 && val[val.size() - 2] > val.back()) {  // pool the violating pair
      const size_t b = val.size() - 1, a = b - 1;
      const double tw = wt[a] + wt[b];
      val[a] = tw > 0 ? (val[a] * wt[a] + val[b] * wt[b]) / tw : (val[a] + val[b]) / 2;
      wt[a] = tw;
      size[a] += size[b];
      val.pop_back();
      wt.pop_back();
      size.pop_back();
    }
  }
  int64_t k = 0;
  for (size_t b = 0; b < val.size(); ++b)
    for (int64_t j = 0; j < size[b]; ++j) out[k++] = val[b];
}

void observe_chains(const float* scores, int64_t rows, int64_t width, const int64_t* drafted,
                    const int64_t* accepted, int points, double window, double* seen_counts,
                    double* accepted_counts) {
  const int64_t cells = static_cast<int64_t>(kDepthBuckets) * points;
  std::vector<int64_t> seen(cells, 0), acc(cells, 0);
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t d = std::min(std::max<int64_t>(drafted[i], 0), width);
    for (int64_t j = 0; j < d; ++j) {
      const double s = std::min(1.0, std::max(0.0, static_cast<double>(scores[i * width + j])));
      const int64_t cell = depth_bucket(j) * static_cast<int64_t>(points) +
                           static_cast<int64_t>(std::nearbyint(s * (points - 1)));
      ++seen[cell];
      if (j < accepted[i]) ++acc[cell];
    }
  }
  for (int64_t c = 0; c < cells; ++c) {
    seen_counts[c] += static_cast<double>(seen[c]);
    accepted_counts[c] += static_cast<double>(acc[c]);
  }
  for (int64_t c = 0; c < cells; ++c)
    if (seen_counts[c] > window) {
      const double f = window / seen_counts[c];
      seen_counts[c] *= f;
      accepted_counts[c] *= f;
    }
}

void acceptance_table(const double* accepted_counts, const double* seen_counts, const double* prior,
                      int64_t rows, int64_t points, double prior_weight, float* out) {
  std::vector<double> est(points), w(points), fit(points);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t o = r * points;
    for (int64_t i = 0; i < points; ++i) {
      est[i] = (accepted_counts[o + i] + prior_weight * prior[o + i]) /
               std::max(seen_counts[o + i] + prior_weight, 1e-12);
      w[i] = seen_counts[o + i] + 1.0;
    }
    isotonic_fit(est.data(), w.data(), points, fit.data());
    for (int64_t i = 0; i < points; ++i) out[o + i] = static_cast<float>(std::min(1.0, std::max(0.0, fit[i])));
  }
}

void cumulative_scores(const float* probs, int64_t rows, int64_t width, const int32_t* lens, float* out) {
  for (int64_t i = 0; i < rows; ++i) {
    float acc = 1.0f;
    for (int64_t j = 0; j < width; ++j) {
      acc = acc * (j < lens[i] ? probs[i * width + j] : 0.0f);
      out[i * width + j] = acc;
    }
  }
}

}  // namespace verl_ext
