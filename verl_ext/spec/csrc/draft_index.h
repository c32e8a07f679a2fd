// The draft index: suffix trees for the four context scopes behind one API.
//
//   request  one tree per live request: its prompt (a closed sequence, indexed to its last
//            token) and its own generated tokens (a second, growing sequence).
//   group    one tree per prompt group (Seer section 4.4): every response of the
//            group is its own sequence, keyed by request id, growing token by token.
//   history  one tree per prompt (RhymeRL HistoSpec, section 5.3): earlier epochs'
//            responses, weighted by reward.
//   global   recent responses to every prompt (Arctic's global tree; off until
//            set_global_tokens): every request's response goes in when it finishes, and
//            add_global adds others. Two generations bound it: responses go into the newer tree until it
//            holds the cap's tokens, then it becomes the older one and the oldest is dropped.
//
// Thread-safety: none inside. The Python binding never releases the GIL, so calls from
// several Python threads are serialized; one index must not be shared between processes.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "suffix_tree.h"

namespace verl_ext {

enum Scope : int {
  kScopeRequest = 1,
  kScopeGroup = 2,
  kScopeHistory = 4,
  kScopeGlobal = 8,
  kScopeAll = 15
};

struct DraftParams {
  int min_match = 1;       // shortest suffix of the context that may match
  int max_match = 16;      // longest suffix tried first (capped at max_depth - 1)
  float min_prob = 0.3f;   // stop when the cumulative probability drops below this
  // Weigh each scope's draft by how its drafts fared for this prompt (ScopeStats): the draft
  // with the highest calibrated expected accepted length wins. Off: the highest score wins.
  bool scope_weights = false;
};

// How one prompt's drafts from each scope (request, group, history, global) fared: the
// scores (expected accepted tokens by the tree's counts) of the drafts observed, and the tokens
// of them the response went on to contain. Weight of a scope: (accepted + kPrior) /
// (score + kPrior), 1 before any observation.
struct ScopeStats {
  static constexpr double kPrior = 4.0;
  double score[4] = {0, 0, 0, 0};
  double accepted[4] = {0, 0, 0, 0};
  double weight(int i) const { return (accepted[i] + kPrior) / (score[i] + kPrior); }
  // A tree slot of RequestEntry (request, group, history, global new, global old) -> its scope.
  static int of_slot(int slot) { return slot < 3 ? slot : 3; }
};

// A draft proposed at context length `at`, waiting for the tokens that decide how much of it
// the response contains (scope weights).
struct PendingDraft {
  uint64_t at = 0;
  float score = 0.0f;
  std::vector<int32_t> tokens;
};

// RhymeRL's AIMD draft window (RhymeRL section 5.4): a request's window starts at `start`
// tokens, grows by `step` after every step whose whole draft was accepted (up to the step's k),
// and falls back to `start` when any drafted token is rejected. start = 0: no window.
struct AimdParams {
  int start = 0;
  int step = 2;
};

struct TreeEntry {
  std::unique_ptr<SuffixTree> tree;
  uint64_t tick = 0;
  uint64_t uid = 0;
  size_t bytes = 0;
};

struct RequestEntry {
  TreeEntry ctx;           // request scope; null once evicted
  std::string group;       // "" = none
  std::string history;     // "" = none
  uint64_t group_uid = 0;  // the group tree this request's sequence lives in
  uint32_t group_seq = 0;
  uint32_t group_pos = 0;  // named sequence: where this request's next token goes in it
  bool group_named = false;  // writes a response's named sequence (shared with its imports)
  std::string group_seq_name;  // that sequence's name
  uint32_t prompt_len = 0;
  uint32_t ctx_len = 0;    // prompt + generated tokens seen so far
  int scopes = kScopeAll;  // scopes this request may draft from
  bool group_write = true; // false: reads its group tree but never writes to it
  WalkMemo memo[5];        // failed context walks per tree (request, group, history, global x2)
  PendingDraft pending[5]; // per tree: the draft being checked against the response (scope weights)
};

struct Proposal {
  Draft draft;
  int scope = 0;
};

struct IndexStats {
  size_t requests = 0, groups = 0, histories = 0, nodes = 0, tokens = 0, bytes = 0;
  size_t global_tokens_held = 0;  // in both global trees (the cap is global_tokens())
  size_t scope_stats = 0;    // prompts with scope weights
  uint64_t evictions = 0;
  uint64_t walks_skipped = 0;  // context walks a WalkMemo showed would fail again
};

// A history tree of `responses` (token arrays with their weights), built without any index:
// safe to run on a thread of its own while the index serves proposals, then installed.
std::unique_ptr<SuffixTree> build_history_tree(
    int max_depth, const std::vector<std::pair<const int32_t*, size_t>>& responses,
    const std::vector<float>& weights);

class DraftIndex {
 public:
  DraftIndex(int max_depth, int64_t max_bytes, int max_draft);

  int max_depth() const { return depth_; }
  int max_draft() const { return max_draft_; }
  int64_t max_bytes() const { return max_bytes_; }
  void set_max_bytes(int64_t b);

  // Requests (request scope, and their sequence in the group tree). With group_write false
  // the request drafts from its group tree (looked up by name at each proposal) but adds no
  // sequence to it, and append/finish leave it alone: the group tree is fed from elsewhere
  // (import_group from a grouped draft server that already has this request's tokens).
  // With `group_seq` the request writes its tokens into that named sequence of its group tree,
  // from token `group_offset` of it on (a chunk of a response continues the response's
  // sequence), skipping tokens already there: a grouped draft server's import of the same
  // response then merges into it instead of adding a second copy. It leaves closing it to the
  // import, and writes a sequence of its own instead where the named one is shorter than
  // `group_offset` (a continuation on another engine) or another live request writes it.
  void start_request(const std::string& req, const int32_t* prompt, size_t n,
                     const std::string& group, const std::string& history,
                     int scopes = kScopeAll, bool group_write = true,
                     const std::string& group_seq = "", size_t group_offset = 0);
  bool has_request(const std::string& req) const { return requests_.count(req) != 0; }
  void append(const std::string& req, const int32_t* toks, size_t n);
  // Brings the request up to date with its full context row: appends row[ctx_len:n].
  // Returns false for an unknown request.
  bool sync(const std::string& req, const int32_t* row, size_t n);
  bool finish(const std::string& req);
  size_t context_length(const std::string& req) const;

  // Groups directly (draft servers, import targets).
  void group_append(const std::string& group, const std::string& seq, const int32_t* toks,
                    size_t n);
  void group_close(const std::string& group, const std::string& seq);
  bool drop_group(const std::string& group);
  // (closed sequences, all sequences) of a group tree; (0, 0) for an unknown group.
  std::pair<size_t, size_t> group_counts(const std::string& group) const;
  // The group tree's version (what export_group would return now); 0 for an unknown group.
  uint64_t group_version(const std::string& group) const;
  // Length and closed flag of one sequence of a group tree; (0, false) when absent.
  std::pair<size_t, bool> group_sequence(const std::string& group, const std::string& seq) const;

  // History: a finished response of `prompt_key`, weight = its reward.
  void add_history(const std::string& key, const int32_t* toks, size_t n, float weight);
  bool drop_history(const std::string& key);
  // Replaces `key`'s history tree by one built elsewhere (build_history_tree, on another
  // thread): O(1) here, so a large history never stalls the thread that drafts. The tree's
  // max depth must be this index's.
  void install_history(const std::string& key, std::unique_ptr<SuffixTree> tree);

  // Global scope: `tokens` per generation (0: off, the default; turning it off drops both
  // trees). A response added while the newer tree holds `tokens` or more rotates first.
  void set_global_tokens(int64_t tokens);
  int64_t global_tokens() const { return global_cap_; }
  void add_global(const int32_t* toks, size_t n, float weight);

  // Proposals. `ctx` is the request's full context (prompt + generated); pass nullptr to use
  // the context stored in the request tree.
  Proposal propose(const std::string& req, const int32_t* ctx, size_t n, int k, int scopes,
                   const DraftParams& p);
  // Exact-match replay (the simulator): each request i decodes along rows[i] from position
  // starts[i] to ends[i] (rows hold prompt + the tokens the engine emits). A step proposes up
  // to k tokens from the request's context, accepts the longest draft prefix equal to the
  // row's next tokens, and emits it plus one token (the target's own), capped at ends[i].
  // Emitted tokens are appended like a decode loop's, so group trees see them from the next
  // step on (each round proposes for every request, then emits). The requests advance in
  // lockstep, one step each per round, for at most max_steps rounds (< 0: until
  // every request reaches its end). Outputs per request and step: tokens emitted and tokens
  // drafted. Unknown requests get no steps. With `aimd.start > 0` each request drafts at most
  // its AIMD window (<= k) per step.
  void replay(const std::vector<std::string>& reqs, const std::vector<const int32_t*>& rows,
              const std::vector<size_t>& starts, const std::vector<size_t>& ends, int k,
              int scopes, const DraftParams& p, int64_t max_steps,
              std::vector<std::vector<int32_t>>* emitted,
              std::vector<std::vector<int32_t>>* drafted, const AimdParams& aimd = AimdParams());
  // Direct access to one tree, for tests and multi-path drafting. The global scope's keys are
  // "new" and "old" (its two generations).
  const SuffixTree* tree(int scope, const std::string& key) const;

  // Group deltas: the sequences changed after version `since` (0: the whole tree). Importing
  // is all-or-nothing and idempotent on tokens already present; it refuses a delta that does
  // not follow on from what the index holds ("missing delta"), including a delta with since > 0
  // for a group the index does not have.
  std::string export_group(const std::string& group, uint64_t since, uint64_t* version);
  size_t import_group(const std::string& blob, const std::string& rename);
  std::string save(int scopes) const;
  size_t load(const std::string& blob);

  IndexStats stats() const;
  void clear();

 private:
  TreeEntry& group_entry(const std::string& group, bool create);
  TreeEntry new_entry();
  bool drop(std::unordered_map<std::string, TreeEntry>& trees, const std::string& key);
  void account(TreeEntry& e);
  // A finished response as a closed sequence of `e`'s tree (history and global trees).
  void add_response(TreeEntry& e, const int32_t* toks, size_t n, float w);
  void evict();

  int depth_;
  int64_t max_bytes_;
  int max_draft_;
  std::unordered_map<std::string, RequestEntry> requests_;
  std::unordered_map<std::string, std::string> named_writers_;  // group \x1f seq -> request
  std::unordered_map<std::string, TreeEntry> groups_, histories_;
  TreeEntry global_[2];  // newer (being filled), older
  // scope weights per prompt: keyed by group, or "\x1e" + request id for a request without one
  std::unordered_map<std::string, ScopeStats> scope_stats_;
  int64_t global_cap_ = 0;
  int64_t bytes_ = 0;
  uint64_t tick_ = 0, uid_ = 0, evictions_ = 0, walks_skipped_ = 0;
};

}  // namespace verl_ext
