#include "draft_index.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <tuple>

namespace verl_ext {

namespace {

// ---- little-endian byte buffers for deltas and checkpoints -------------------------------
struct Writer {
  std::string out;
  template <class T>
  void put(T v) {
    out.append(reinterpret_cast<const char*>(&v), sizeof(T));
  }
  void str(const std::string& s) {
    put<uint32_t>(static_cast<uint32_t>(s.size()));
    out.append(s);
  }
  void toks(const int32_t* t, size_t n) {
    put<uint32_t>(static_cast<uint32_t>(n));
    out.append(reinterpret_cast<const char*>(t), n * sizeof(int32_t));
  }
};

struct Reader {
  const std::string& in;
  size_t at = 0;
  const char* what;
  void need(size_t n) {
    if (at + n > in.size()) throw std::invalid_argument(std::string(what) + ": truncated data");
  }
  template <class T>
  T get() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, in.data() + at, sizeof(T));
    at += sizeof(T);
    return v;
  }
  std::string str() {
    const uint32_t n = get<uint32_t>();
    need(n);
    std::string s = in.substr(at, n);
    at += n;
    return s;
  }
  std::vector<int32_t> toks() {
    const uint32_t n = get<uint32_t>();
    need(static_cast<size_t>(n) * 4);
    std::vector<int32_t> v(n);
    if (n) std::memcpy(v.data(), in.data() + at, static_cast<size_t>(n) * 4);
    at += static_cast<size_t>(n) * 4;
    for (int32_t t : v)
      if (t < 0) throw std::invalid_argument(std::string(what) + ": negative token id");
    return v;
  }
};

bool valid_weight(float w) { return w >= 0.0f && w <= 3.0e38f; }  // false for NaN

constexpr uint32_t kDeltaMagic = 0x44535856;  // "VXSD"
constexpr uint32_t kSaveMagic = 0x49535856;   // "VXSI"
constexpr uint32_t kFormat = 1;       // checkpoints
constexpr uint32_t kDeltaFormat = 2;  // group deltas: 2 added the base version

struct SeqRecord {
  std::string key;
  float weight;
  bool closed;
  uint32_t start;
  std::vector<int32_t> toks;
};

void write_seq(Writer& w, const Sequence& s, uint32_t start) {
  w.str(s.key);
  w.put<float>(s.weight);
  w.put<uint8_t>(s.closed ? 1 : 0);
  w.put<uint32_t>(start);
  w.toks(s.tokens.data() + start, s.tokens.size() - start);
}

SeqRecord read_seq(Reader& r) {
  SeqRecord s;
  s.key = r.str();
  s.weight = r.get<float>();
  s.closed = r.get<uint8_t>() != 0;
  s.start = r.get<uint32_t>();
  s.toks = r.toks();
  if (!valid_weight(s.weight))
    throw std::invalid_argument(std::string(r.what) + ": bad sequence weight");
  return s;
}

// Applies records to a tree after checking all of them; never leaves a half-applied tree.
size_t apply_records(SuffixTree& t, const std::vector<SeqRecord>& recs) {
  for (const SeqRecord& r : recs) {
    const int id = t.find_sequence(r.key);
    const size_t have = id < 0 ? 0 : t.sequence(id).tokens.size();
    if (r.start > have)
      throw std::invalid_argument("delta for '" + r.key + "' starts at " +
                                  std::to_string(r.start) + " but only " +
                                  std::to_string(have) + " tokens are present (missing delta)");
    if (id >= 0) {
      const Sequence& s = t.sequence(id);
      const size_t overlap = std::min(have - r.start, r.toks.size());
      if (!std::equal(r.toks.begin(), r.toks.begin() + overlap, s.tokens.begin() + r.start))
        throw std::invalid_argument("delta for '" + r.key + "' disagrees with stored tokens");
      if (s.closed && r.start + r.toks.size() > have)
        throw std::invalid_argument("delta appends to closed sequence '" + r.key + "'");
    }
  }
  size_t applied = 0;
  for (const SeqRecord& r : recs) {
    int id = t.find_sequence(r.key);
    if (id < 0) id = static_cast<int>(t.add_sequence(r.key, r.weight));
    const Sequence& s = t.sequence(id);
    const size_t have = s.tokens.size();
    const size_t skip = have - r.start;
    if (r.toks.size() > skip) {
      t.append(id, r.toks.data() + skip, r.toks.size() - skip);
      applied += r.toks.size() - skip;
    }
    if (r.closed) t.close(id);
  }
  return applied;
}

}  // namespace

DraftIndex::DraftIndex(int max_depth, int64_t max_bytes, int max_draft)
    : depth_(max_depth), max_bytes_(max_bytes), max_draft_(max_draft) {
  if (max_depth < 2 || max_depth > kMaxDepthLimit)
    throw std::invalid_argument("max_depth must be in [2, 255], got " + std::to_string(max_depth));
  if (max_bytes < 0) throw std::invalid_argument("max_bytes must be >= 0 (0 = no cap)");
  if (max_draft < 1) throw std::invalid_argument("max_draft must be >= 1");
}

void DraftIndex::set_max_bytes(int64_t b) {
  if (b < 0) throw std::invalid_argument("max_bytes must be >= 0 (0 = no cap)");
  max_bytes_ = b;
  evict();
}

void DraftIndex::account(TreeEntry& e) {
  e.tick = ++tick_;
  if (!e.tree) return;
  const size_t now = e.tree->memory_bytes();
  bytes_ += static_cast<int64_t>(now) - static_cast<int64_t>(e.bytes);
  e.bytes = now;
}

TreeEntry DraftIndex::new_entry() {
  TreeEntry e;
  e.tree = std::make_unique<SuffixTree>(depth_);
  e.uid = ++uid_;
  return e;
}

bool DraftIndex::drop(std::unordered_map<std::string, TreeEntry>& trees, const std::string& key) {
  auto it = trees.find(key);
  if (it == trees.end()) return false;
  bytes_ -= static_cast<int64_t>(it->second.bytes);
  trees.erase(it);
  return true;
}

TreeEntry& DraftIndex::group_entry(const std::string& group, bool create) {
  auto it = groups_.find(group);
  if (it != groups_.end()) return it->second;
  if (!create) throw std::out_of_range("unknown group '" + group + "'");
  TreeEntry& e = groups_[group] = new_entry();
  account(e);
  return e;
}

namespace {
std::string writer_key(const std::string& group, const std::string& seq) {
  return group + '\x1f' + seq;
}
}  // namespace

void DraftIndex::start_request(const std::string& req, const int32_t* prompt, size_t n,
                               const std::string& group, const std::string& history,
                               int scopes, bool group_write, const std::string& group_seq,
                               size_t group_offset) {
  if (requests_.count(req)) throw std::invalid_argument("request '" + req + "' is already active");
  RequestEntry r;
  r.ctx.tree = std::make_unique<SuffixTree>(depth_);
  // The prompt is complete, so it is indexed as a closed sequence (all its windows, right up
  // to its last token); the response grows as a second sequence.
  r.ctx.tree->add_sequence("prompt", 1.0f);
  r.ctx.tree->append(0, prompt, n);
  r.ctx.tree->close(0);
  r.ctx.tree->add_sequence("response", 1.0f);
  r.prompt_len = r.ctx_len = static_cast<uint32_t>(n);
  r.group = group;
  r.history = history;
  r.scopes = scopes;
  r.group_write = group_write;
  if (!group.empty() && group_write) {
    TreeEntry& g = group_entry(group, true);
    // A named sequence (a response several chunks write in turn) is taken over when no other
    // request writes it and it holds the tokens before this chunk's offset; otherwise the
    // request writes a sequence of its own.
    std::string key;
    int id = -1;
    bool named = false;
    if (!group_seq.empty()) {
      key = writer_key(group, group_seq);
      id = g.tree->find_sequence(group_seq);
      const size_t have = id < 0 ? 0 : g.tree->sequence(id).tokens.size();
      named = !named_writers_.count(key) && have >= group_offset;
    }
    if (named) {
      if (id < 0) id = static_cast<int>(g.tree->add_sequence(group_seq, 1.0f));
      r.group_seq = static_cast<uint32_t>(id);
      r.group_pos = static_cast<uint32_t>(group_offset);
      r.group_named = true;
      r.group_seq_name = group_seq;
      named_writers_.emplace(std::move(key), req);
    } else {
      if (g.tree->find_sequence(req) >= 0)
        throw std::invalid_argument("request '" + req + "' already has a sequence in group '" +
                                    group + "'");
      r.group_seq = g.tree->add_sequence(req, 1.0f);
    }
    r.group_uid = g.uid;
    account(g);
  }
  RequestEntry& slot = requests_.emplace(req, std::move(r)).first->second;
  account(slot.ctx);
  evict();
}

void DraftIndex::append(const std::string& req, const int32_t* toks, size_t n) {
  auto it = requests_.find(req);
  if (it == requests_.end()) throw std::out_of_range("unknown request '" + req + "'");
  RequestEntry& r = it->second;
  if (n == 0) return;
  if (r.ctx.tree) {
    r.ctx.tree->append(1, toks, n);
    account(r.ctx);
  }
  r.ctx_len += static_cast<uint32_t>(n);
  if (!r.group.empty() && r.group_write) {
    auto g = groups_.find(r.group);
    if (g != groups_.end() && g->second.uid == r.group_uid) {
      SuffixTree& t = *g->second.tree;
      if (!r.group_named) {
        t.append(r.group_seq, toks, n);
      } else {  // append what the named sequence lacks from here (an import may be ahead)
        const Sequence& s = t.sequence(r.group_seq);
        const size_t have = s.tokens.size(), pos = r.group_pos;
        if (!s.closed && have >= pos && pos + n > have) t.append(r.group_seq, toks + (have - pos), pos + n - have);
        r.group_pos += static_cast<uint32_t>(n);
      }
      account(g->second);
    }
  }
  evict();
}

bool DraftIndex::sync(const std::string& req, const int32_t* row, size_t n) {
  auto it = requests_.find(req);
  if (it == requests_.end()) return false;
  if (n > it->second.ctx_len) append(req, row + it->second.ctx_len, n - it->second.ctx_len);
  return true;
}

bool DraftIndex::finish(const std::string& req) {
  auto it = requests_.find(req);
  if (it == requests_.end()) return false;
  RequestEntry& r = it->second;
  if (r.group_named) {  // the response may go on in another chunk: its import closes it
    auto w = named_writers_.find(writer_key(r.group, r.group_seq_name));
    if (w != named_writers_.end() && w->second == req) named_writers_.erase(w);
  }
  if (!r.group.empty() && r.group_write) {
    auto g = groups_.find(r.group);
    if (g != groups_.end() && g->second.uid == r.group_uid && !r.group_named) {
      g->second.tree->close(r.group_seq);
      account(g->second);
    }
  }
  if (global_cap_ > 0 && r.ctx.tree) {  // every response, whatever scopes it drafted from
    const auto& response = r.ctx.tree->sequence(1).tokens;
    if (!response.empty()) add_global(response.data(), response.size(), 1.0f);
  }
  if (r.group.empty()) scope_stats_.erase("\x1e" + req);
  bytes_ -= static_cast<int64_t>(r.ctx.bytes);
  requests_.erase(it);
  evict();
  return true;
}

void DraftIndex::set_global_tokens(int64_t tokens) {
  if (tokens < 0) throw std::invalid_argument("global tokens must be >= 0 (0 = off), got " + std::to_string(tokens));
  global_cap_ = tokens;
  if (tokens == 0)
    for (TreeEntry& e : global_) {
      bytes_ -= static_cast<int64_t>(e.bytes);
      e = TreeEntry();
    }
}

void DraftIndex::add_global(const int32_t* toks, size_t n, float w) {
  if (global_cap_ <= 0) throw std::logic_error("the global scope is off (set_global_tokens first)");
  if (!valid_weight(w))
    throw std::invalid_argument("global weight must be finite and >= 0, got " + std::to_string(w));
  if (n == 0) return;
  TreeEntry& fresh = global_[0];
  if (fresh.tree && static_cast<int64_t>(fresh.tree->num_tokens()) >= global_cap_) {
    bytes_ -= static_cast<int64_t>(global_[1].bytes);
    global_[1] = std::move(fresh);
    fresh = TreeEntry();
  }
  if (!fresh.tree) fresh = new_entry();
  add_response(fresh, toks, n, w);
}

void DraftIndex::add_response(TreeEntry& e, const int32_t* toks, size_t n, float w) {
  const uint32_t id = e.tree->add_sequence(std::to_string(e.tree->num_sequences()), w);
  e.tree->append(id, toks, n);
  e.tree->close(id);
  account(e);
  evict();
}

size_t DraftIndex::context_length(const std::string& req) const {
  auto it = requests_.find(req);
  if (it == requests_.end()) throw std::out_of_range("unknown request '" + req + "'");
  return it->second.ctx_len;
}

void DraftIndex::group_append(const std::string& group, const std::string& seq,
                              const int32_t* toks, size_t n) {
  TreeEntry& g = group_entry(group, true);
  int id = g.tree->find_sequence(seq);
  if (id < 0) id = static_cast<int>(g.tree->add_sequence(seq, 1.0f));
  g.tree->append(id, toks, n);
  account(g);
  evict();
}

void DraftIndex::group_close(const std::string& group, const std::string& seq) {
  TreeEntry& g = group_entry(group, false);
  const int id = g.tree->find_sequence(seq);
  if (id < 0) throw std::out_of_range("group '" + group + "' has no sequence '" + seq + "'");
  g.tree->close(id);
  account(g);
  evict();
}

bool DraftIndex::drop_group(const std::string& group) {
  scope_stats_.erase(group);
  return drop(groups_, group);
}

std::pair<size_t, size_t> DraftIndex::group_counts(const std::string& group) const {
  auto it = groups_.find(group);
  if (it == groups_.end() || !it->second.tree) return {0, 0};
  const SuffixTree& t = *it->second.tree;
  size_t closed = 0;
  for (size_t i = 0; i < t.num_sequences(); ++i) closed += t.sequence(i).closed ? 1 : 0;
  return {closed, t.num_sequences()};
}

uint64_t DraftIndex::group_version(const std::string& group) const {
  auto it = groups_.find(group);
  return it == groups_.end() || !it->second.tree ? 0 : it->second.tree->version();
}

std::pair<size_t, bool> DraftIndex::group_sequence(const std::string& group,
                                                   const std::string& seq) const {
  auto it = groups_.find(group);
  if (it == groups_.end() || !it->second.tree) return {0, false};
  const int id = it->second.tree->find_sequence(seq);
  if (id < 0) return {0, false};
  const Sequence& s = it->second.tree->sequence(id);
  return {s.tokens.size(), s.closed};
}

void DraftIndex::add_history(const std::string& key, const int32_t* toks, size_t n, float w) {
  if (!valid_weight(w))
    throw std::invalid_argument("history weight must be finite and >= 0, got " + std::to_string(w));
  TreeEntry& e = histories_[key];
  if (!e.tree) e = new_entry();
  add_response(e, toks, n, w);
}

bool DraftIndex::drop_history(const std::string& key) { return drop(histories_, key); }

std::unique_ptr<SuffixTree> build_history_tree(
    int max_depth, const std::vector<std::pair<const int32_t*, size_t>>& responses,
    const std::vector<float>& weights) {
  if (max_depth < 2 || max_depth > kMaxDepthLimit)
    throw std::invalid_argument("max_depth must be in [2, 255], got " + std::to_string(max_depth));
  if (responses.size() != weights.size())
    throw std::invalid_argument("a history tree needs one weight per response");
  for (float w : weights)
    if (!valid_weight(w))
      throw std::invalid_argument("history weight must be finite and >= 0, got " + std::to_string(w));
  auto tree = std::make_unique<SuffixTree>(max_depth);
  for (size_t i = 0; i < responses.size(); ++i) {
    const uint32_t id = tree->add_sequence(std::to_string(i), weights[i]);
    tree->append(id, responses[i].first, responses[i].second);
    tree->close(id);
  }
  return tree;
}

void DraftIndex::install_history(const std::string& key, std::unique_ptr<SuffixTree> tree) {
  if (!tree) throw std::invalid_argument("install_history: no tree (already installed?)");
  if (tree->max_depth() != depth_)
    throw std::invalid_argument("install_history: tree depth " + std::to_string(tree->max_depth()) +
                                " differs from the index's " + std::to_string(depth_));
  drop(histories_, key);
  TreeEntry e;
  e.tree = std::move(tree);
  e.uid = ++uid_;
  TreeEntry& slot = histories_[key] = std::move(e);
  account(slot);
  evict();
}

Proposal DraftIndex::propose(const std::string& req, const int32_t* ctx, size_t n, int k,
                             int scopes, const DraftParams& p) {
  Proposal best;
  if (k < 0 || k > max_draft_)
    throw std::invalid_argument("k=" + std::to_string(k) + " is outside [0, max_draft=" +
                                std::to_string(max_draft_) + "]");
  if (k == 0) return best;
  auto it = requests_.find(req);
  if (it == requests_.end()) return best;
  RequestEntry& r = it->second;
  scopes &= r.scopes;
  std::vector<int32_t> joined;
  uint64_t base = 0;  // absolute context position of ctx[0]
  if (ctx == nullptr) {  // prompt + response from the request tree
    if (!r.ctx.tree) return best;
    // Only the context's last max(max_match, max_depth) tokens are matched (SuffixTree::propose
    // and propose_recent match suffixes of at most min(max_match, max_depth - 1) tokens).
    const auto& a = r.ctx.tree->sequence(0).tokens;
    const auto& b = r.ctx.tree->sequence(1).tokens;
    const size_t keep = static_cast<size_t>(std::max(p.max_match, depth_));
    const size_t from_b = std::min(b.size(), keep), from_a = std::min(a.size(), keep - from_b);
    joined.reserve(from_a + from_b);
    joined.insert(joined.end(), a.end() - from_a, a.end());
    joined.insert(joined.end(), b.end() - from_b, b.end());
    ctx = joined.data();
    n = joined.size();
    base = r.ctx_len - n;
  }
  const uint64_t end = base + n;  // absolute context length
  ScopeStats* stats = nullptr;
  if (p.scope_weights) {
    stats = &scope_stats_[r.group.empty() ? "\x1e" + req : r.group];
    // Settle the drafts whose fate the context now shows: a mismatch inside the new tokens, or
    // new tokens covering the whole draft. The others wait for more tokens.
    for (int slot = 0; slot < 5; ++slot) {
      PendingDraft& pd = r.pending[slot];
      if (pd.tokens.empty() || pd.at >= end) continue;
      if (pd.at < base) {  // older than the context passed in: cannot be checked
        pd.tokens.clear();
        continue;
      }
      const size_t avail = std::min<size_t>(end - pd.at, pd.tokens.size());
      const int32_t* got = ctx + (pd.at - base);
      size_t m = 0;
      while (m < avail && got[m] == pd.tokens[m]) ++m;
      if (m == avail && end - pd.at < pd.tokens.size()) continue;
      stats->score[ScopeStats::of_slot(slot)] += pd.score;
      stats->accepted[ScopeStats::of_slot(slot)] += static_cast<double>(m);
      pd.tokens.clear();
    }
  }
  double best_value = 0.0;
  auto consider = [&](TreeEntry* e, int scope, int slot) {
    if (!e || !e->tree) return;
    e->tick = ++tick_;
    WalkMemo& memo = r.memo[slot];
    if (memo.uid != e->uid) {
      memo.uid = e->uid;
      memo.clear();
    }
    const uint64_t skipped = memo.skipped;
    Draft d = e->tree->propose(ctx, n, k, p.min_match, p.max_match, p.min_prob, &memo, base);
    walks_skipped_ += memo.skipped - skipped;
    // The newest tokens of growing sequences are not in the tree yet; a longer match there
    // (e.g. a sibling a few tokens ahead, or a short loop) is the better evidence.
    Draft recent = e->tree->propose_recent(ctx, n, k, std::max(p.min_match, d.match_len + 1), p.max_match);
    if (!recent.tokens.empty()) d = std::move(recent);
    if (d.tokens.empty()) return;
    double value = d.score;
    if (stats) {
      value *= stats->weight(ScopeStats::of_slot(slot));
      PendingDraft& pd = r.pending[slot];
      if (pd.tokens.empty()) pd = PendingDraft{end, d.score, d.tokens};
    }
    if (best.draft.tokens.empty() || value > best_value ||
        (value == best_value && d.match_len > best.draft.match_len)) {
      best_value = value;
      best.draft = std::move(d);
      best.scope = scope;
    }
  };
  if (scopes & kScopeRequest) consider(&r.ctx, kScopeRequest, 0);
  if ((scopes & kScopeGroup) && !r.group.empty()) {
    auto g = groups_.find(r.group);
    if (g != groups_.end()) consider(&g->second, kScopeGroup, 1);
  }
  if ((scopes & kScopeHistory) && !r.history.empty()) {
    auto h = histories_.find(r.history);
    if (h != histories_.end()) consider(&h->second, kScopeHistory, 2);
  }
  if (scopes & kScopeGlobal) {
    consider(&global_[0], kScopeGlobal, 3);
    consider(&global_[1], kScopeGlobal, 4);
  }
  return best;
}

void DraftIndex::replay(const std::vector<std::string>& reqs,
                        const std::vector<const int32_t*>& rows,
                        const std::vector<size_t>& starts, const std::vector<size_t>& ends, int k,
                        int scopes, const DraftParams& p, int64_t max_steps,
                        std::vector<std::vector<int32_t>>* emitted,
                        std::vector<std::vector<int32_t>>* drafted, const AimdParams& aimd) {
  const size_t n = reqs.size();
  if (aimd.start < 0 || aimd.step < 0)
    throw std::invalid_argument("replay: AIMD start and step must be >= 0");
  if (rows.size() != n || starts.size() != n || ends.size() != n)
    throw std::invalid_argument("replay: reqs, rows, starts and ends differ in length");
  if (k < 0 || k > max_draft_)
    throw std::invalid_argument("k=" + std::to_string(k) + " is outside [0, max_draft=" +
                                std::to_string(max_draft_) + "]");
  emitted->assign(n, {});
  drafted->assign(n, {});
  std::vector<size_t> pos(starts);
  std::vector<int> window(n, aimd.start > 0 ? std::min(aimd.start, k) : k);
  std::vector<size_t> live;
  for (size_t i = 0; i < n; ++i) {
    if (starts[i] > ends[i]) throw std::invalid_argument("replay: a start is past its end");
    if (pos[i] < ends[i] && sync(reqs[i], rows[i], pos[i])) live.push_back(i);
  }
  std::vector<Proposal> props;
  for (int64_t round = 0; !live.empty() && (max_steps < 0 || round < max_steps); ++round) {
    // A step drafts for the whole batch first, then emits: a step's tokens become visible to
    // other requests (group trees) from the next step on, as with a real engine.
    props.clear();
    for (size_t i : live) props.push_back(propose(reqs[i], rows[i], pos[i], window[i], scopes, p));
    size_t kept = 0;
    for (size_t j = 0; j < live.size(); ++j) {
      const size_t i = live[j];
      const int32_t* row = rows[i];
      const auto& d = props[j].draft.tokens;
      const size_t left = ends[i] - pos[i];
      size_t acc = 0;
      while (acc < d.size() && acc + 1 < left && d[acc] == row[pos[i] + acc]) ++acc;
      const size_t emit = std::min(acc + 1, left);
      append(reqs[i], row + pos[i], emit);
      pos[i] += emit;
      (*emitted)[i].push_back(static_cast<int32_t>(emit));
      (*drafted)[i].push_back(static_cast<int32_t>(d.size()));
      if (aimd.start > 0 && !d.empty())
        window[i] = acc == d.size() ? std::min(window[i] + aimd.step, k) : std::min(aimd.start, k);
      if (pos[i] < ends[i]) live[kept++] = i;
    }
    live.resize(kept);
  }
}

const SuffixTree* DraftIndex::tree(int scope, const std::string& key) const {
  if (scope == kScopeRequest) {
    auto it = requests_.find(key);
    return it == requests_.end() ? nullptr : it->second.ctx.tree.get();
  }
  if (scope == kScopeGlobal) {
    if (key != "new" && key != "old") throw std::invalid_argument("global trees are 'new' and 'old'");
    return global_[key == "new" ? 0 : 1].tree.get();
  }
  const auto& m = scope == kScopeGroup ? groups_ : histories_;
  if (scope != kScopeGroup && scope != kScopeHistory)
    throw std::invalid_argument("scope must be one of 1 (request), 2 (group), 4 (history), 8 (global)");
  auto it = m.find(key);
  return it == m.end() ? nullptr : it->second.tree.get();
}

std::string DraftIndex::export_group(const std::string& group, uint64_t since,
                                     uint64_t* version) {
  TreeEntry& g = group_entry(group, false);
  SuffixTree& t = *g.tree;
  if (since > t.version())
    throw std::invalid_argument("version " + std::to_string(since) + " is newer than group '" +
                                group + "' (" + std::to_string(t.version()) + ")");
  const auto changes = t.changes_since(since);
  Writer w;
  w.put<uint32_t>(kDeltaMagic);
  w.put<uint32_t>(kDeltaFormat);
  w.str(group);
  w.put<uint64_t>(t.version());
  w.put<uint64_t>(since);
  w.put<uint32_t>(static_cast<uint32_t>(changes.size()));
  for (const auto& [seq, start] : changes) write_seq(w, t.sequence(seq), start);
  *version = t.version();
  account(g);
  return std::move(w.out);
}

size_t DraftIndex::import_group(const std::string& blob, const std::string& rename) {
  Reader r{blob, 0, "group delta"};
  if (r.get<uint32_t>() != kDeltaMagic) throw std::invalid_argument("not a verl_ext group delta");
  if (r.get<uint32_t>() != kDeltaFormat) throw std::invalid_argument("unsupported group delta format");
  std::string group = r.str();
  r.get<uint64_t>();
  const uint64_t base = r.get<uint64_t>();
  const uint32_t count = r.get<uint32_t>();
  std::vector<SeqRecord> recs;
  for (uint32_t i = 0; i < count; ++i) recs.push_back(read_seq(r));
  if (r.at != blob.size()) throw std::invalid_argument("group delta: trailing bytes");
  if (!rename.empty()) group = rename;
  auto existing = groups_.find(group);
  if (existing == groups_.end()) {
    // A delta (base > 0) presumes the earlier contents; without the tree (never imported, or
    // evicted) it would leave a tree missing the sequences that did not change since.
    if (base > 0)
      throw std::invalid_argument("group delta since version " + std::to_string(base) +
                                  " for group '" + group + "', which this index does not have "
                                  "(missing delta: import the whole group, since=0)");
    SuffixTree probe(depth_);  // validate against an empty tree before creating the group
    apply_records(probe, recs);
  }
  TreeEntry& g = group_entry(group, true);
  const size_t n = apply_records(*g.tree, recs);
  account(g);
  evict();
  return n;
}

std::string DraftIndex::save(int scopes) const {
  Writer w;
  w.put<uint32_t>(kSaveMagic);
  w.put<uint32_t>(kFormat);
  std::vector<std::tuple<uint8_t, const std::string*, const SuffixTree*>> trees;
  if (scopes & kScopeGroup)
    for (const auto& [k, e] : groups_) trees.emplace_back(kScopeGroup, &k, e.tree.get());
  if (scopes & kScopeHistory)
    for (const auto& [k, e] : histories_) trees.emplace_back(kScopeHistory, &k, e.tree.get());
  w.put<uint32_t>(static_cast<uint32_t>(trees.size()));
  for (const auto& [scope, key, t] : trees) {
    w.put<uint8_t>(scope);
    w.str(*key);
    w.put<uint32_t>(static_cast<uint32_t>(t->num_sequences()));
    for (size_t i = 0; i < t->num_sequences(); ++i) write_seq(w, t->sequence(i), 0);
  }
  return std::move(w.out);
}

size_t DraftIndex::load(const std::string& blob) {
  Reader r{blob, 0, "index checkpoint"};
  if (r.get<uint32_t>() != kSaveMagic) throw std::invalid_argument("not a verl_ext index checkpoint");
  if (r.get<uint32_t>() != kFormat) throw std::invalid_argument("unsupported checkpoint format");
  const uint32_t count = r.get<uint32_t>();
  struct Item {
    uint8_t scope;
    std::string key;
    std::vector<SeqRecord> seqs;
  };
  std::vector<Item> items;
  for (uint32_t i = 0; i < count; ++i) {
    Item it;
    it.scope = r.get<uint8_t>();
    if (it.scope != kScopeGroup && it.scope != kScopeHistory)
      throw std::invalid_argument("index checkpoint: bad scope");
    it.key = r.str();
    const uint32_t ns = r.get<uint32_t>();
    for (uint32_t j = 0; j < ns; ++j) {
      it.seqs.push_back(read_seq(r));
      if (it.seqs.back().start != 0) throw std::invalid_argument("index checkpoint: bad sequence");
    }
    items.push_back(std::move(it));
  }
  if (r.at != blob.size()) throw std::invalid_argument("index checkpoint: trailing bytes");
  size_t tokens = 0;
  for (Item& it : items) {
    auto& m = it.scope == kScopeGroup ? groups_ : histories_;
    drop(m, it.key);
    TreeEntry e = new_entry();
    tokens += apply_records(*e.tree, it.seqs);
    TreeEntry& slot = m[it.key];
    slot = std::move(e);
    account(slot);
  }
  evict();
  return tokens;
}

IndexStats DraftIndex::stats() const {
  IndexStats s;
  s.requests = requests_.size();
  s.groups = groups_.size();
  s.histories = histories_.size();
  auto add = [&](const TreeEntry& e) {
    if (!e.tree) return;
    s.nodes += e.tree->num_nodes();
    s.tokens += e.tree->num_tokens();
  };
  for (const auto& [k, r] : requests_) add(r.ctx);
  for (const auto& [k, e] : groups_) add(e);
  for (const auto& [k, e] : histories_) add(e);
  s.scope_stats = scope_stats_.size();
  for (const TreeEntry& e : global_) {
    add(e);
    if (e.tree) s.global_tokens_held += e.tree->num_tokens();
  }
  s.bytes = static_cast<size_t>(bytes_);
  s.evictions = evictions_;
  s.walks_skipped = walks_skipped_;
  return s;
}

void DraftIndex::clear() {
  requests_.clear();
  named_writers_.clear();
  groups_.clear();
  histories_.clear();
  scope_stats_.clear();
  for (TreeEntry& e : global_) e = TreeEntry();
  bytes_ = 0;
}

// Least recently used trees go first until the index is back under 90% of the cap. A
// request whose tree is evicted stays known (its group sequence keeps growing) but drafts
// only from its group and history from then on.
void DraftIndex::evict() {
  if (max_bytes_ <= 0 || bytes_ <= max_bytes_) return;
  struct Victim {
    uint64_t tick;
    int scope;
    const std::string* key;
  };
  std::vector<Victim> v;
  for (auto& [k, r] : requests_)
    if (r.ctx.tree) v.push_back({r.ctx.tick, kScopeRequest, &k});
  for (auto& [k, e] : groups_) v.push_back({e.tick, kScopeGroup, &k});
  for (auto& [k, e] : histories_) v.push_back({e.tick, kScopeHistory, &k});
  std::sort(v.begin(), v.end(), [](const Victim& a, const Victim& b) { return a.tick < b.tick; });
  const int64_t target = max_bytes_ - max_bytes_ / 10;
  std::vector<std::pair<int, std::string>> drop;
  for (const Victim& x : v) {
    if (bytes_ <= target) break;
    if (x.scope == kScopeRequest) {
      RequestEntry& r = requests_[*x.key];
      bytes_ -= static_cast<int64_t>(r.ctx.bytes);
      r.ctx.tree.reset();
      r.ctx.bytes = 0;
    } else {
      auto& m = x.scope == kScopeGroup ? groups_ : histories_;
      bytes_ -= static_cast<int64_t>(m[*x.key].bytes);
      drop.emplace_back(x.scope, *x.key);
    }
    ++evictions_;
  }
  for (auto& [scope, key] : drop) (scope == kScopeGroup ? groups_ : histories_).erase(key);
}

}  // namespace verl_ext
