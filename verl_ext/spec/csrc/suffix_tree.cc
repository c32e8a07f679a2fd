#include "suffix_tree.h"

#include <algorithm>
#include <stdexcept>

namespace verl_ext {

// ----------------------------------------------------------------------------- ChildTable

namespace {
inline uint64_t mix(uint64_t k) {  // splitmix64 finalizer
  k ^= k >> 30;
  k *= 0xbf58476d1ce4e5b9ull;
  k ^= k >> 27;
  k *= 0x94d049bb133111ebull;
  k ^= k >> 31;
  return k;
}
}  // namespace

uint32_t ChildTable::find(uint64_t key) const {
  if (keys_.empty()) return kNil;
  const size_t mask = keys_.size() - 1;
  for (size_t i = mix(key) & mask;; i = (i + 1) & mask) {
    const uint64_t k = keys_[i];
    if (k == key) return vals_[i];
    if (k == kEmpty) return kNil;
  }
}

void ChildTable::put(uint64_t key, uint32_t value) {
  if ((used_ + 1) * 10 > keys_.size() * 7) grow();
  const size_t mask = keys_.size() - 1;
  size_t tomb = SIZE_MAX;
  for (size_t i = mix(key) & mask;; i = (i + 1) & mask) {
    const uint64_t k = keys_[i];
    if (k == key) {
      vals_[i] = value;
      return;
    }
    if (k == kTomb && tomb == SIZE_MAX) tomb = i;
    if (k == kEmpty) {
      if (tomb != SIZE_MAX) {
        i = tomb;
      } else {
        ++used_;
      }
      keys_[i] = key;
      vals_[i] = value;
      ++live_;
      return;
    }
  }
}

void ChildTable::erase(uint64_t key) {
  if (keys_.empty()) return;
  const size_t mask = keys_.size() - 1;
  for (size_t i = mix(key) & mask;; i = (i + 1) & mask) {
    const uint64_t k = keys_[i];
    if (k == key) {
      keys_[i] = kTomb;
      --live_;
      return;
    }
    if (k == kEmpty) return;
  }
}

void ChildTable::grow() {
  std::vector<uint64_t> keys;
  std::vector<uint32_t> vals;
  keys.swap(keys_);
  vals.swap(vals_);
  size_t cap = 16;
  while (cap * 7 < (live_ + 1) * 20) cap *= 2;  // load <= 0.35 right after growing
  keys_.assign(cap, kEmpty);
  vals_.assign(cap, kNil);
  used_ = live_ = 0;
  for (size_t i = 0; i < keys.size(); ++i)
    if (keys[i] != kEmpty && keys[i] != kTomb) put(keys[i], vals[i]);
}

// ----------------------------------------------------------------------------- WalkMemo

void WalkMemo::fit(size_t span) {
  if (fails.size() >= span) return;
  size_t cap = 16;
  while (cap < span) cap *= 2;
  std::vector<Fail> prev(cap, Fail{kNone, 0, 0, 0});
  prev.swap(fails);  // fails: the new slots; prev: the entries to re-place
  for (const Fail& x : prev)
    if (x.start != kNone) at(x.start) = x;
}

// ----------------------------------------------------------------------------- SuffixTree

SuffixTree::SuffixTree(int max_depth) : depth_(max_depth) {
  if (max_depth < 2 || max_depth > kMaxDepthLimit)
    throw std::invalid_argument("max_depth must be in [2, 255], got " + std::to_string(max_depth));
  nodes_.push_back(Node{0, 0, 0.0f, kNil, kNil});  // root: empty label
}

uint32_t SuffixTree::new_node(uint32_t seq, uint32_t p, uint32_t l, float prio) {
  if (nodes_.size() >= kNil - 1) throw std::length_error("suffix tree node limit reached");
  nodes_.push_back(Node{seq, p | (l << 24), prio, kNil, kNil});
  return static_cast<uint32_t>(nodes_.size() - 1);
}

uint32_t SuffixTree::find_child(uint32_t n, int32_t token) const {
  if (is_hub(n)) return table_.find(key(n, static_cast<uint32_t>(token)));
  for (uint32_t c = nodes_[n].first_child; c != kNil; c = nodes_[c].next_sibling)
    if (label(c)[0] == token) return c;
  return kNil;
}

uint32_t SuffixTree::best_child(uint32_t n) const {
  if (is_hub(n)) return table_.find(key(n, kBestKey));
  return nodes_[n].first_child;
}

void SuffixTree::add_child(uint32_t parent, uint32_t child) {
  const uint32_t d = deg(parent);
  Node& p = nodes_[parent];
  if (d < 255) p.seq_deg = (p.seq_deg & 0xFFFFFFu) | ((d + 1) << 24);
  if (d >= kHubDegree) {  // already a hub: the table indexes the children
    nodes_[child].next_sibling = p.first_child;
    p.first_child = child;
    table_.put(key(parent, static_cast<uint32_t>(label(child)[0])), child);
    const uint32_t best = table_.find(key(parent, kBestKey));
    if (best == kNil || nodes_[child].prio > nodes_[best].prio)
      table_.put(key(parent, kBestKey), child);
    return;
  }
  // Small node: keep a best child first.
  const uint32_t head = p.first_child;
  if (head == kNil || nodes_[child].prio > nodes_[head].prio) {
    nodes_[child].next_sibling = head;
    p.first_child = child;
  } else {
    nodes_[child].next_sibling = nodes_[head].next_sibling;
    nodes_[head].next_sibling = child;
  }
  if (d + 1 == kHubDegree) {  // becomes a hub
    for (uint32_t c = nodes_[parent].first_child; c != kNil; c = nodes_[c].next_sibling)
      table_.put(key(parent, static_cast<uint32_t>(label(c)[0])), c);
    table_.put(key(parent, kBestKey), nodes_[parent].first_child);
  }
}

void SuffixTree::raised(uint32_t parent, uint32_t child) {
  if (is_hub(parent)) {
    const uint32_t best = table_.find(key(parent, kBestKey));
    if (best != child && nodes_[child].prio > nodes_[best].prio)
      table_.put(key(parent, kBestKey), child);
    return;
  }
  const uint32_t head = nodes_[parent].first_child;
  if (head == child || nodes_[child].prio <= nodes_[head].prio) return;
  uint32_t prev = head;
  while (nodes_[prev].next_sibling != child) prev = nodes_[prev].next_sibling;
  nodes_[prev].next_sibling = nodes_[child].next_sibling;
  nodes_[child].next_sibling = head;
  nodes_[parent].first_child = child;
}

uint32_t SuffixTree::split(uint32_t n, uint32_t at) {
  const bool hub = is_hub(n);
  const Node old = nodes_[n];
  const uint32_t lower = new_node(seq_of(n), pos(n) + at, len(n) - at, old.prio);
  nodes_[lower].first_child = old.first_child;
  nodes_[lower].seq_deg = (nodes_[lower].seq_deg & 0xFFFFFFu) | (old.seq_deg & 0xFF000000u);
  Node& upper = nodes_[n];
  upper.pos_len = pos(n) | (at << 24);
  upper.first_child = lower;
  upper.seq_deg = (upper.seq_deg & 0xFFFFFFu) | (1u << 24);
  if (hub) {  // re-key the children under the lower node
    for (uint32_t c = nodes_[lower].first_child; c != kNil; c = nodes_[c].next_sibling) {
      const uint32_t tok = static_cast<uint32_t>(label(c)[0]);
      table_.erase(key(n, tok));
      table_.put(key(lower, tok), c);
    }
    const uint32_t best = table_.find(key(n, kBestKey));
    table_.erase(key(n, kBestKey));
    table_.put(key(lower, kBestKey), best);
  }
  return lower;
}

void SuffixTree::insert_window(uint32_t seq, uint32_t start, uint32_t length, float w) {
  const int32_t* x = data_[seq] + start;
  if (stamps_) ++stamps_[bucket(x[0])];
  uint32_t node = 0;
  nodes_[0].prio += w;
  uint32_t i = 0;
  while (i < length) {
    const uint32_t c = find_child(node, x[i]);
    if (c == kNil) {
      add_child(node, new_node(seq, start + i, length - i, w));
      return;
    }
    const uint32_t l = len(c);
    const int32_t* lb = label(c);
    uint32_t j = 1;
    while (j < l && i + j < length && lb[j] == x[i + j]) ++j;
    if (j < l) split(c, j);
    nodes_[c].prio += w;
    raised(node, c);
    i += j;
    if (j < l) {  // split: the window either ends here or diverges here
      if (i < length) add_child(c, new_node(seq, start + i, length - i, w));
      return;
    }
    node = c;
  }
}

uint32_t SuffixTree::add_sequence(const std::string& k, float weight) {
  if (seqs_.size() >= kMaxSeqs) throw std::length_error("too many sequences in one tree");
  const uint32_t id = static_cast<uint32_t>(seqs_.size());
  seqs_.emplace_back();
  data_.push_back(nullptr);
  Sequence& s = seqs_.back();
  s.key = k;
  s.weight = weight;
  seq_bytes_ += s.key.capacity();
  by_key_.emplace(k, id);
  touch(s);
  return id;
}

int SuffixTree::find_sequence(const std::string& k) const {
  auto it = by_key_.find(k);
  return it == by_key_.end() ? -1 : static_cast<int>(it->second);
}

void SuffixTree::touch(Sequence& s) {
  if (s.marks.empty() || s.marks.back().first < last_export_) {
    const size_t cap = s.marks.capacity();
    s.marks.emplace_back(version_, static_cast<uint32_t>(s.tokens.size()));
    seq_bytes_ += (s.marks.capacity() - cap) * sizeof(s.marks[0]);
  }
  s.last_mod = ++version_;
}

void SuffixTree::append(uint32_t seq, const int32_t* tokens, size_t n) {
  Sequence& s = seqs_[seq];
  if (s.closed) throw std::logic_error("sequence '" + s.key + "' is closed");
  if (n == 0) return;
  if (s.tokens.size() + n >= kMaxSeqLen) throw std::length_error("sequence longer than 2^24 tokens");
  touch(s);
  const size_t cap = s.tokens.capacity();
  s.tokens.insert(s.tokens.end(), tokens, tokens + n);
  token_bytes_ += (s.tokens.capacity() - cap) * sizeof(int32_t);
  data_[seq] = s.tokens.data();
  num_tokens_ += n;
  const uint32_t d = static_cast<uint32_t>(depth_);
  while (s.inserted + d <= s.tokens.size()) {
    insert_window(seq, s.inserted, d, s.weight);
    ++seqs_[seq].inserted;
  }
}

void SuffixTree::close(uint32_t seq) {
  Sequence& s = seqs_[seq];
  if (s.closed) return;
  touch(s);
  const uint32_t n = static_cast<uint32_t>(s.tokens.size());
  while (s.inserted < n) {
    insert_window(seq, s.inserted, n - s.inserted, s.weight);
    ++seqs_[seq].inserted;
  }
  seqs_[seq].closed = true;
}

bool SuffixTree::walk(const int32_t* s, size_t n, Cursor& cur) const {
  return match(s, n, cur) == n;
}

size_t SuffixTree::match(const int32_t* s, size_t n, Cursor& cur) const {
  uint32_t node = 0, off = 0;
  for (size_t i = 0; i < n; ++i) {
    if (off == len(node)) {
      const uint32_t c = find_child(node, s[i]);
      if (c == kNil) return i;
      node = c;
      off = 1;
    } else {
      if (label(node)[off] != s[i]) return i;
      ++off;
    }
  }
  cur.node = node;
  cur.off = off;
  return n;
}

namespace {
uint64_t hash_tokens(const int32_t* s, size_t n) {
  uint64_t h = 0x9e3779b97f4a7c15ull ^ n;
  for (size_t i = 0; i < n; ++i) {
    h ^= static_cast<uint32_t>(s[i]);
    h *= 0x100000001b3ull;
    h ^= h >> 29;
  }
  return h;
}
}  // namespace

bool SuffixTree::draft_from(Cursor cur, int depth, int k, float min_prob, float& cum,
                            Draft& out) const {
  uint32_t node = cur.node, off = cur.off;
  for (int i = 0; i < k; ++i, ++depth) {
    if (depth >= depth_) return true;
    int32_t tok;
    float p = 1.0f;
    if (off < len(node)) {  // inside an edge: every window here continues the same way
      tok = label(node)[off++];
    } else {
      const uint32_t c = best_child(node);
      if (c == kNil) return false;
      const float total = nodes_[node].prio;
      p = total > 0.0f ? std::min(1.0f, nodes_[c].prio / total) : 0.0f;
      if (p <= 0.0f || cum * p < min_prob) return false;
      tok = label(c)[0];
      node = c;
      off = 1;
    }
    cum *= p;
    out.tokens.push_back(tok);
    out.probs.push_back(p);
    out.score += cum;
  }
  return false;
}

Draft SuffixTree::propose(const int32_t* ctx, size_t n, int k, int min_len, int max_len,
                          float min_prob, WalkMemo* memo, uint64_t base) const {
  Draft d;
  if (k <= 0 || n == 0) return d;
  const int lo = std::max(min_len, 1);
  const int hi = std::min<int>({max_len, static_cast<int>(std::min<size_t>(n, 1 << 20)), depth_ - 1});
  const uint64_t end = base + n;
  if (memo) {
    if (!stamps_) stamps_.reset(new uint32_t[size_t{1} << kStampBits]());
    memo->fit(static_cast<size_t>(hi) + 1);
  }
  // A walk recorded as failed fails again: same tokens, no window with that first-token
  // bucket inserted since (the stamp), and the failing prefix inside this context.
  auto failed = [&](uint64_t start, const int32_t* s, int l) {
    WalkMemo::Fail& x = memo->at(start);
    if (x.start != start) return false;
    if (x.len <= static_cast<uint32_t>(l) && x.stamp == stamp(s[0]) && x.hash == hash_tokens(s, x.len))
      return true;
    x.start = WalkMemo::kNone;
    return false;
  };
  float cum = 1.0f;
  bool at_depth = false;
  for (int l = hi; l >= lo; --l) {
    Cursor cur;
    const int32_t* s = ctx + n - l;
    if (memo && failed(end - l, s, l)) {
      ++memo->skipped;
      continue;
    }
    const size_t m = match(s, static_cast<size_t>(l), cur);
    if (m < static_cast<size_t>(l)) {
      if (memo)
        memo->at(end - l) = WalkMemo::Fail{end - l, hash_tokens(s, m + 1),
                                           static_cast<uint32_t>(m + 1), stamp(s[0])};
      continue;
    }
    cum = 1.0f;
    at_depth = draft_from(cur, l, k, min_prob, cum, d);
    if (!d.tokens.empty()) {
      d.match_len = l;
      break;
    }
    d.score = 0.0f;
  }
  // A draft that ran into the depth limit continues from a re-match of its own tail, so
  // long drafts are not capped at max_depth - match length.
  std::vector<int32_t> tail;
  while (at_depth && static_cast<int>(d.tokens.size()) < k) {
    const int m = std::min(hi, depth_ / 2);
    if (m < lo) break;
    tail.assign(ctx + n - std::min<size_t>(n, static_cast<size_t>(m)), ctx + n);
    tail.insert(tail.end(), d.tokens.begin(), d.tokens.end());
    const int mm = std::min<int>(m, static_cast<int>(tail.size()));
    if (mm < lo) break;
    const int32_t* t = tail.data() + tail.size() - mm;
    Cursor cur;
    if (!walk(t, static_cast<size_t>(mm), cur)) break;
    const size_t before = d.tokens.size();
    at_depth = draft_from(cur, mm, k - static_cast<int>(before), min_prob, cum, d);
    if (d.tokens.size() == before) break;
  }
  return d;
}

Draft SuffixTree::propose_recent(const int32_t* ctx, size_t n, int k, int min_len,
                                 int max_len) const {
  Draft d;
  if (k <= 0 || n == 0) return d;
  const size_t hi = static_cast<size_t>(std::max(0, std::min<int>(max_len, depth_ - 1)));
  const size_t lo = static_cast<size_t>(std::max(min_len, 1));
  const int32_t* best_seq = nullptr;
  size_t best_len = 0, best_end = 0, best_size = 0;
  for (const Sequence& s : seqs_) {
    if (s.closed) continue;
    const size_t m = s.tokens.size();
    if (m < 2) continue;
    const int32_t* x = s.tokens.data();
    const size_t from = m > static_cast<size_t>(depth_) + hi ? m - depth_ - hi : 1;
    const int32_t last = ctx[n - 1];
    for (size_t e = m - 1; e >= from; --e) {  // occurrence ends at e, continues with x[e]
      if (x[e - 1] != last) {  // the common case: not even the last token matches
        if (e == from) break;
        continue;
      }
      size_t l = 0;
      const size_t cap = std::min({hi, e, n});
      while (l < cap && x[e - 1 - l] == ctx[n - 1 - l]) ++l;
      if (l >= lo && l > best_len) {
        best_len = l;
        best_end = e;
        best_seq = x;
        best_size = m;
      }
      if (e == from) break;
    }
  }
  if (!best_seq) return d;
  const size_t stop = std::min(best_size, best_end + static_cast<size_t>(k));
  for (size_t i = best_end; i < stop; ++i) {
    d.tokens.push_back(best_seq[i]);
    d.probs.push_back(1.0f);
    d.score += 1.0f;
  }
  d.match_len = static_cast<int>(best_len);
  return d;
}

std::vector<Draft> SuffixTree::propose_paths(const int32_t* ctx, size_t n, int k, int min_len,
                                             int max_len, float min_prob, int num_paths) const {
  std::vector<Draft> out;
  if (num_paths <= 0) return out;
  const Draft first = propose(ctx, n, k, min_len, max_len, min_prob);
  if (first.tokens.empty()) return out;
  const int l = first.match_len;
  struct Beam {
    Cursor cur;
    float cum;
    Draft d;
    bool done;
  };
  Cursor start;
  walk(ctx + n - l, static_cast<size_t>(l), start);
  // A path's cumulative probability telescopes to prio(end) / prio(start); computing it that way
  // (not as a running product) makes equal-probability paths compare equal, so ties fall to
  // the score deterministically.
  const float start_prio = nodes_[start.node].prio;
  std::vector<Beam> beams{Beam{start, 1.0f, Draft{}, false}};
  for (int step = 0; step < k && l + step < depth_; ++step) {
    std::vector<Beam> next;
    bool grew = false;
    for (Beam& b : beams) {
      if (b.done) {
        next.push_back(std::move(b));
        continue;
      }
      const uint32_t node = b.cur.node;
      if (b.cur.off < len(node)) {
        Beam e = b;
        e.d.tokens.push_back(label(node)[e.cur.off++]);
        e.d.probs.push_back(1.0f);
        e.d.score += e.cum;
        next.push_back(std::move(e));
        grew = true;
        continue;
      }
      // Children by prio, best `num_paths` of them.
      std::vector<std::pair<float, uint32_t>> kids;
      for (uint32_t c = nodes_[node].first_child; c != kNil; c = nodes_[c].next_sibling)
        kids.emplace_back(nodes_[c].prio, c);
      const size_t keep = std::min<size_t>(kids.size(), static_cast<size_t>(num_paths));
      // Ties (equal prios) go to the smaller token, so the result does not depend on the
      // order children were created in.
      std::partial_sort(kids.begin(), kids.begin() + keep, kids.end(), [this](auto& a, auto& b) {
        return a.first != b.first ? a.first > b.first : label(a.second)[0] < label(b.second)[0];
      });
      const float total = nodes_[node].prio;
      bool extended = false;
      for (size_t i = 0; i < keep; ++i) {
        const float p = total > 0.0f ? std::min(1.0f, kids[i].first / total) : 0.0f;
        const float cum = start_prio > 0.0f ? std::min(1.0f, kids[i].first / start_prio) : 0.0f;
        if (p <= 0.0f || cum < min_prob) break;
        Beam e = b;
        e.cur = Cursor{kids[i].second, 1};
        e.cum = cum;
        e.d.tokens.push_back(label(kids[i].second)[0]);
        e.d.probs.push_back(p);
        e.d.score += e.cum;
        next.push_back(std::move(e));
        extended = grew = true;
      }
      if (!extended) {
        b.done = true;
        next.push_back(std::move(b));
      }
    }
    std::stable_sort(next.begin(), next.end(), [](const Beam& a, const Beam& b) {
      if (a.cum != b.cum) return a.cum > b.cum;
      if (a.d.score != b.d.score) return a.d.score > b.d.score;
      return a.d.tokens < b.d.tokens;
    });
    if (next.size() > static_cast<size_t>(num_paths)) next.resize(num_paths);
    beams.swap(next);
    if (!grew) break;
  }
  for (Beam& b : beams) {
    if (b.d.tokens.empty()) continue;
    b.d.match_len = l;
    out.push_back(std::move(b.d));
  }
  std::stable_sort(out.begin(), out.end(), [](const Draft& a, const Draft& b) {
    return a.score != b.score ? a.score > b.score : a.tokens < b.tokens;
  });
  return out;
}

double SuffixTree::priority(const int32_t* s, size_t n) const {
  Cursor cur;
  if (!walk(s, n, cur)) return 0.0;
  return nodes_[cur.node].prio;
}

std::vector<std::pair<std::vector<int32_t>, float>> SuffixTree::dump() const {
  std::vector<std::pair<std::vector<int32_t>, float>> out;
  std::vector<std::pair<uint32_t, std::vector<int32_t>>> stack{{0u, {}}};
  while (!stack.empty()) {
    auto [n, path] = std::move(stack.back());
    stack.pop_back();
    if (n != 0) out.emplace_back(path, nodes_[n].prio);
    for (uint32_t c = nodes_[n].first_child; c != kNil; c = nodes_[c].next_sibling) {
      std::vector<int32_t> p = path;
      p.insert(p.end(), label(c), label(c) + len(c));
      stack.emplace_back(c, std::move(p));
    }
  }
  return out;
}

size_t SuffixTree::memory_bytes() const {
  return nodes_.capacity() * sizeof(Node) + table_.bytes() + token_bytes_ + seq_bytes_ +
         (stamps_ ? sizeof(uint32_t) << kStampBits : 0) +
         seqs_.capacity() * (sizeof(Sequence) + sizeof(const int32_t*)) + by_key_.size() * 48 +
         sizeof(*this);
}

std::vector<std::pair<uint32_t, uint32_t>> SuffixTree::changes_since(uint64_t since) {
  std::vector<std::pair<uint32_t, uint32_t>> out;
  for (uint32_t i = 0; i < seqs_.size(); ++i) {
    const Sequence& s = seqs_[i];
    if (s.last_mod <= since) continue;
    auto it = std::lower_bound(s.marks.begin(), s.marks.end(), since,
                               [](const auto& m, uint64_t v) { return m.first < v; });
    out.emplace_back(i, it == s.marks.end() ? 0u : it->second);
  }
  last_export_ = version_;
  return out;
}

}  // namespace verl_ext
