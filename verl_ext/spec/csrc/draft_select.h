// Workload-aware draft selection: RLHFSpec section 5.3, layer-level strategy search.
//
// Input: a draft forest (every request's draft; a linear draft is a chain), each node with a
// score (its cumulative draft probability), a monotone map F from score to acceptance
// probability (the node's weight w = F(score)), and the predicted step time t[N] of a step that
// verifies N draft tokens in total. The search grows the selected set one node at a time, always
// taking the heaviest node whose parent is already selected (a max-priority queue over the
// frontier: a node enters the queue when its layer is reached through its parent, so S(n) stays
// a connected tree within the first n layers: the paper's principles 1 and 2), and evaluates
// Equation 2, al(n) / t_sd(n), with al(n) = base + sum of the selected weights (base: the tokens
// the step emits without drafts, one per request). It returns the best n seen. Early stopping
// (Equation 3): once the objective has fallen `patience` times in a row the search ends;
// patience = 0 searches exhaustively.
#pragma once

#include <cstdint>
#include <vector>

namespace verl_ext {

struct SelectResult {
  int64_t n = 0;             // draft tokens selected (argmax of the objective)
  int64_t evaluations = 0;   // objective evaluations (nodes popped)
  double objective = 0.0;    // al(n) / t(n) at the selected n
  double al = 0.0;           // predicted tokens emitted at the selected n
  std::vector<int32_t> order;  // popped nodes, in order (the first n are selected)
};

// F: one row per depth bucket (depth_bucket), each piecewise linear through (i / (m - 1),
// row[i]), i = 0..m-1; scores clipped to [0, 1]. With `rows` = 1 every depth reads row 0.
constexpr int kDepthBuckets = 7;
inline int depth_bucket(int64_t depth) { return depth < 4 ? static_cast<int>(depth) : depth < 8 ? 4 : depth < 16 ? 5 : 6; }
double acceptance_weight(double score, int64_t depth, const float* f, int m, int rows);

// Linear drafts: row i has lens[i] nodes with cumulative scores scores[i * width + j]; node
// (i, j) has parent (i, j - 1). `order` holds flat indices i * width + j.
SelectResult select_chains(const float* scores, int64_t rows, int64_t width, const int32_t* lens,
                           const float* f, int m, int f_rows, const double* t, int64_t t_len,
                           double base, int patience);

// A general draft forest (tree verification): parents[u] < 0 for a root, else its parent.
SelectResult select_tree(const int32_t* parents, const float* scores, int64_t nodes,
                         const float* f, int m, int f_rows, const double* t, int64_t t_len,
                         double base, int patience);

// F's refit (AcceptanceModel.table): the non-decreasing weighted least-squares fit of y[0..n)
// with positive weights w, by pool-adjacent-violators, into out[0..n).
void isotonic_fit(const double* y, const double* w, int64_t n, double* out);

// F's online counts (AcceptanceModel.observe over one step's linear drafts): row i drafted
// drafted[i] tokens (at most width) with cumulative scores scores[i * width + j], and the target
// accepted the first accepted[i]. Node (i, j) counts at depth bucket depth_bucket(j) and the
// grid point nearest its score clipped to [0, 1] (rounded half to even, as numpy's rint): one
// more seen there, and one more accepted where j < accepted[i]. The step's counts are added per
// point at once; then every point seen more than `window` times is scaled down to `window`
// (accepted with it). seen and accepted: kDepthBuckets x points, row-major.
void observe_chains(const float* scores, int64_t rows, int64_t width, const int64_t* drafted,
                    const int64_t* accepted, int points, double window, double* seen_counts,
                    double* accepted_counts);

// F's table from its counts (AcceptanceModel.table): per point (accepted + m prior) /
// max(seen + m, 1e-12) with m = prior_weight, made non-decreasing along each row with weights
// seen + 1 (isotonic_fit), clipped to [0, 1]. All arrays rows x points, row-major.
void acceptance_table(const double* accepted_counts, const double* seen_counts, const double* prior,
                      int64_t rows, int64_t points, double prior_weight, float* out);

// Cumulative draft scores: out[i, j] = prod_{l <= j} p[i, l] for j < lens[i], 0 after (float32
// products, left to right).
void cumulative_scores(const float* probs, int64_t rows, int64_t width, const int32_t* lens, float* out);

}  // namespace verl_ext
