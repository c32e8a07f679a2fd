// Depth-limited, path-compressed, weighted generalized suffix tree.
//
// One tree indexes many token sequences (a request's context, the responses of a prompt
// group, or earlier epochs' responses of one prompt). Every sequence is its own set of
// paths: tokens of different sequences are never concatenated.
//
// Contents (the definition the tests check against a brute-force reference):
//   for each sequence x (length n, weight w) and each start s, the window x[s : s + D] is
//   inserted as a root path once it is complete (s + D <= n), and the shorter tail windows
//   when the sequence is closed. D is `max_depth`.
//   prio(u) = sum of w over inserted windows that have u as a prefix.
// With w = 1 everywhere prio is the occurrence count (arctic-inference, Seer's CST); with
// w = reward it is RhymeRL's priority (section 5.3): a leaf carries the rewards
// of the responses ending in that suffix and a parent the sum of its children.
//
// Appending a token inserts at most one window: O(D) work and at most two new nodes.
// Nodes are 20 bytes; edge labels point into the stored sequences (4 bytes per token).
// Nodes with many children ("hubs") are indexed by one open-addressing table per tree.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace verl_ext {

constexpr uint32_t kNil = 0xFFFFFFFFu;
constexpr int kMaxDepthLimit = 255;          // edge lengths are stored in 8 bits
constexpr uint32_t kMaxSeqLen = (1u << 24);  // label positions are stored in 24 bits
constexpr uint32_t kMaxSeqs = (1u << 24);

struct Node {
  uint32_t seq_deg;       // label sequence (low 24 bits) | child count, saturating (high 8)
  uint32_t pos_len;       // label start (low 24 bits) | label length (high 8 bits)
  float prio;             // sum of weights of windows passing through this node
  uint32_t first_child;
  uint32_t next_sibling;  // for non-hub nodes the first child is always a best child
};
static_assert(sizeof(Node) == 20, "Node must stay 20 bytes");

// (parent, token) -> child for hub nodes; key (parent, kBestKey) -> best child.
class ChildTable {
 public:
  static constexpr uint64_t kEmpty = ~0ull;
  static constexpr uint64_t kTomb = ~0ull - 1;
  uint32_t find(uint64_t key) const;
  void put(uint64_t key, uint32_t value);
  void erase(uint64_t key);
  size_t bytes() const { return keys_.capacity() * 8 + vals_.capacity() * 4; }

 private:
  void grow();
  std::vector<uint64_t> keys_;
  std::vector<uint32_t> vals_;
  size_t used_ = 0;  // live + tombstones
  size_t live_ = 0;
};

struct Sequence {
  std::vector<int32_t> tokens;
  std::string key;
  float weight = 1.0f;
  bool closed = false;
  uint32_t inserted = 0;          // windows [0, inserted) are in the tree
  uint64_t last_mod = 0;          // tree version of the last change
  // (tree version before a change, length before it): recorded at the first change after
  // each export, so that the length at any exported version can be found (delta export).
  std::vector<std::pair<uint64_t, uint32_t>> marks;
};

// A position in the tree: `off` tokens into the label of `node` (off == label length means
// "at the node"). The root has an empty label.
struct Cursor {
  uint32_t node = 0;
  uint32_t off = 0;
};

// Context walks that failed at an earlier proposal of the same request against the same
// tree, so that the next proposal can skip them. A walk from context position `start` fails
// when ctx[start : start + len] is not a root path. The root paths that begin with a token
// change only when a window beginning with it is inserted, so the failure stands while the
// tree's insert stamp for that token's bucket is unchanged and the tokens are the same (their
// hash). Positions are absolute in the request's context; the owner calls `clear` when the
// tree is replaced (`uid`). Skipping them gives the very proposal a full search gives.
struct WalkMemo {
  struct Fail {
    uint64_t start;
    uint64_t hash;
    uint32_t len;
    uint32_t stamp;
  };
  static constexpr uint64_t kNone = ~0ull;
  uint64_t uid = 0;
  // Direct-mapped by start (a power-of-two size, start == kNone: empty): the starts one
  // proposal walks (at most max_len consecutive positions) map to distinct slots. An entry is
  // used only by a walk from its own start, so a slot left by a start that moved out of the
  // window is overwritten or ignored, never mistaken for another start's.
  std::vector<Fail> fails;
  uint64_t skipped = 0;  // walks skipped so far
  Fail& at(uint64_t start) { return fails[start & (fails.size() - 1)]; }  // after fit()
  // Room for a window of `span` starts; the entries kept are re-placed.
  void fit(size_t span);
  void clear() { fails.assign(fails.size(), Fail{kNone, 0, 0, 0}); }
};

struct Draft {
  std::vector<int32_t> tokens;
  std::vector<float> probs;  // conditional probability of each token given the previous ones
  float score = 0.0f;        // sum of cumulative probabilities: expected accepted tokens
  int match_len = 0;
};

class SuffixTree {
 public:
  explicit SuffixTree(int max_depth);

  int max_depth() const { return depth_; }
  // Adds an empty sequence; `key` must be unique in this tree (checked by the caller).
  uint32_t add_sequence(const std::string& key, float weight);
  void append(uint32_t seq, const int32_t* tokens, size_t n);
  void close(uint32_t seq);

  // Longest suffix of `ctx` (length in [min_len, max_len]) that is a root path and has a
  // continuation; then a linear draft of up to k tokens following the best branch while the
  // cumulative probability stays >= min_prob. Empty draft if nothing qualifies.
  // With `memo` (the request's failed walks against this tree; `base` is the absolute context
  // position of ctx[0]) the walks recorded there as failed are skipped and new failures added.
  Draft propose(const int32_t* ctx, size_t n, int k, int min_len, int max_len,
                float min_prob, WalkMemo* memo = nullptr, uint64_t base = 0) const;
  // The same for the newest tokens of open sequences, which are not yet in the tree (a window
  // is inserted once complete): the most recent place where the longest context suffix
  // (length in [min_len, max_len]) occurs in the last max_depth + max_len tokens of an open
  // sequence, followed by what came next there. Probabilities are 1 (a single observation).
  Draft propose_recent(const int32_t* ctx, size_t n, int k, int min_len, int max_len) const;
  // Up to `num_paths` drafts (beam search over cumulative probability), best first.
  std::vector<Draft> propose_paths(const int32_t* ctx, size_t n, int k, int min_len,
                                   int max_len, float min_prob, int num_paths) const;
  // prio(u), 0 when u is not in the tree.
  double priority(const int32_t* s, size_t n) const;
  // Every node as (path string, prio); used by tests to compare trees.
  std::vector<std::pair<std::vector<int32_t>, float>> dump() const;

  size_t num_sequences() const { return seqs_.size(); }
  const Sequence& sequence(uint32_t i) const { return seqs_[i]; }
  int find_sequence(const std::string& key) const;
  size_t num_nodes() const { return nodes_.size(); }
  size_t num_tokens() const { return num_tokens_; }
  size_t memory_bytes() const;
  uint64_t version() const { return version_; }

  // Delta export: sequences changed after `since` (a version returned by an earlier export,
  // or 0 for everything), as (sequence, start offset). Marks the export point.
  std::vector<std::pair<uint32_t, uint32_t>> changes_since(uint64_t since);

 private:
  uint32_t seq_of(uint32_t n) const { return nodes_[n].seq_deg & 0xFFFFFFu; }
  uint32_t deg(uint32_t n) const { return nodes_[n].seq_deg >> 24; }
  uint32_t pos(uint32_t n) const { return nodes_[n].pos_len & 0xFFFFFFu; }
  uint32_t len(uint32_t n) const { return nodes_[n].pos_len >> 24; }
  const int32_t* label(uint32_t n) const { return data_[seq_of(n)] + pos(n); }
  bool is_hub(uint32_t n) const { return deg(n) >= kHubDegree; }
  static uint64_t key(uint32_t parent, uint32_t token) {
    return (static_cast<uint64_t>(parent) << 32) | token;
  }

  uint32_t new_node(uint32_t seq, uint32_t pos, uint32_t len, float prio);
  uint32_t find_child(uint32_t n, int32_t token) const;
  uint32_t best_child(uint32_t n) const;
  void add_child(uint32_t parent, uint32_t child);
  void raised(uint32_t parent, uint32_t child);  // child's prio went up
  uint32_t split(uint32_t n, uint32_t at);       // returns the new lower node
  void insert_window(uint32_t seq, uint32_t start, uint32_t length, float w);
  void touch(Sequence& s);
  bool walk(const int32_t* s, size_t n, Cursor& cur) const;
  // Tokens of s[0:n] matched from the root (n on success, then `cur` is where it ends).
  size_t match(const int32_t* s, size_t n, Cursor& cur) const;
  // Windows inserted so far that begin with a token of `tok`'s bucket (WalkMemo).
  uint32_t stamp(int32_t tok) const { return stamps_ ? stamps_[bucket(tok)] : 0; }
  static size_t bucket(int32_t tok) { return static_cast<uint32_t>(tok) * 2654435761u >> (32 - kStampBits); }
  // Extends `out` by up to k tokens; returns true if it stopped at the depth limit.
  bool draft_from(Cursor cur, int depth, int k, float min_prob, float& cum, Draft& out) const;

  static constexpr uint32_t kHubDegree = 8;
  static constexpr int kStampBits = 9;
  static constexpr uint32_t kBestKey = 0xFFFFFFFFu;

  int depth_;
  std::vector<Node> nodes_;
  ChildTable table_;
  std::vector<Sequence> seqs_;
  std::vector<const int32_t*> data_;  // seqs_[i].tokens.data(), kept dense for label()
  std::unordered_map<std::string, uint32_t> by_key_;
  size_t num_tokens_ = 0;
  size_t token_bytes_ = 0;  // capacity of all token vectors, in bytes
  size_t seq_bytes_ = 0;    // capacity of all sequences' marks and keys, in bytes
  uint64_t version_ = 0;
  uint64_t last_export_ = 0;
  // Insert counts per first-token bucket; allocated at the first memoized walk (none before it
  // can have been recorded), so trees that are never walked with a memo do not pay for them.
  mutable std::unique_ptr<uint32_t[]> stamps_;
};

}  // namespace verl_ext
