// pybind11 bindings for the draft index (module verl_ext.spec._suffix).
// Every call holds the GIL for its whole duration (see draft_index.h for the contract), except
// build_history, which builds a tree no index can see yet.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <climits>
#include <cstring>

#include "draft_index.h"
#include "draft_select.h"

namespace py = pybind11;
using namespace verl_ext;

namespace {

// A 1-D token sequence from any integer array-like; zero-copy for contiguous int32.
struct Tokens {
  const int32_t* ptr = nullptr;
  size_t n = 0;
  py::array keep;
  std::vector<int32_t> own;
};

// Token ids are non-negative; `what` names the argument in the error.
void check_ids(const int32_t* p, size_t n, const char* what) {
  for (size_t i = 0; i < n; ++i)
    if (p[i] < 0)
      throw py::value_error(std::string(what) + " has a negative token id " + std::to_string(p[i]));
}

Tokens tokens_of(const py::handle& obj, const char* what) {
  Tokens t;
  py::array arr = py::array::ensure(obj);
  if (!arr) throw py::value_error(std::string(what) + " must be a sequence of token ids");
  if (arr.size() == 0) return t;
  if (arr.ndim() != 1) throw py::value_error(std::string(what) + " must be one-dimensional");
  const char kind = arr.dtype().kind();
  if (kind != 'i' && kind != 'u')
    throw py::value_error(std::string(what) + " must hold integer token ids, got dtype " +
                          std::string(py::str(arr.dtype())));
  t.n = static_cast<size_t>(arr.size());
  if (arr.dtype().is(py::dtype::of<int32_t>()) && (arr.flags() & py::array::c_style)) {
    t.keep = arr;
    t.ptr = static_cast<const int32_t*>(arr.data());
    check_ids(t.ptr, t.n, what);
    return t;
  }
  if (kind == 'u' && arr.itemsize() == 8) {
    auto u = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>::ensure(arr);
    for (size_t i = 0; i < t.n; ++i)
      if (u.data()[i] > static_cast<uint64_t>(INT32_MAX))
        throw py::value_error(std::string(what) + " has token id " + std::to_string(u.data()[i]) +
                              " outside int32");
  }
  auto a = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(arr);
  t.own.resize(t.n);
  for (size_t i = 0; i < t.n; ++i) {
    const int64_t v = a.data()[i];
    if (v < 0 || v > INT32_MAX)
      throw py::value_error(std::string(what) + " has token id " + std::to_string(v) +
                            " outside [0, 2^31 - 1]");
    t.own[i] = static_cast<int32_t>(v);
  }
  t.ptr = t.own.data();
  return t;
}

// The engine batch: rows[i, :lens[i]] is the full context of keys[i].
struct Batch {
  py::array_t<int32_t, py::array::c_style | py::array::forcecast> rows;
  py::array_t<int64_t, py::array::c_style | py::array::forcecast> lens;
  py::array_t<int64_t, py::array::c_style | py::array::forcecast> ks;
  bool has_rows = false;
  size_t width = 0;
};

Batch batch_of(size_t b, const py::object& ks, const py::object& rows, const py::object& lens,
               int max_draft) {
  Batch x;
  if (py::isinstance<py::int_>(ks)) {
    x.ks = py::array_t<int64_t>(b);
    std::fill(x.ks.mutable_data(), x.ks.mutable_data() + b, ks.cast<int64_t>());
  } else {
    x.ks = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(ks);
    if (!x.ks || x.ks.ndim() != 1 || static_cast<size_t>(x.ks.size()) != b)
      throw py::value_error("ks must be an int or one k per key");
  }
  for (size_t i = 0; i < b; ++i) {
    const int64_t k = x.ks.data()[i];
    if (k < 0 || k > max_draft)
      throw py::value_error("k=" + std::to_string(k) + " is outside [0, max_draft=" +
                            std::to_string(max_draft) + "]");
  }
  if (rows.is_none() != lens.is_none())
    throw py::value_error("token_rows and lens go together");
  if (!rows.is_none()) {
    x.rows = py::array_t<int32_t, py::array::c_style | py::array::forcecast>::ensure(rows);
    x.lens = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(lens);
    if (!x.rows || x.rows.ndim() != 2 || static_cast<size_t>(x.rows.shape(0)) < b)
      throw py::value_error("token_rows must be a 2-D array with a row per key");
    if (!x.lens || x.lens.ndim() != 1 || static_cast<size_t>(x.lens.size()) < b)
      throw py::value_error("lens must be 1-D with a length per key");
    x.width = static_cast<size_t>(x.rows.shape(1));
    for (size_t i = 0; i < b; ++i)
      if (x.lens.data()[i] < 0 || static_cast<size_t>(x.lens.data()[i]) > x.width)
        throw py::value_error("lens[" + std::to_string(i) + "] is outside the row width");
    x.has_rows = true;
  }
  return x;
}

template <class Emit>
void run_batch(DraftIndex& idx, const std::vector<std::string>& keys, Batch& x, int scopes,
               const DraftParams& p, bool sync, Emit emit) {
  for (size_t i = 0; i < keys.size(); ++i) {
    const int32_t* row = nullptr;
    size_t n = 0;
    if (x.has_rows) {
      row = x.rows.data() + i * x.width;
      n = static_cast<size_t>(x.lens.data()[i]);
      if (sync) idx.sync(keys[i], row, n);
    }
    Proposal pr = idx.propose(keys[i], row, n, static_cast<int>(x.ks.data()[i]), scopes, p);
    emit(i, pr);
  }
}

DraftParams params(int min_match, int max_match, float min_prob, bool scope_weights = false) {
  if (min_match < 1) throw py::value_error("min_match must be >= 1");
  if (max_match < min_match) throw py::value_error("max_match must be >= min_match");
  if (!(min_prob >= 0.0f && min_prob <= 1.0f)) throw py::value_error("min_prob must be in [0, 1]");
  return DraftParams{min_match, max_match, min_prob, scope_weights};
}

const SuffixTree& tree_of(const DraftIndex& idx, int scope, const std::string& key) {
  const SuffixTree* t = idx.tree(scope, key);
  if (!t) throw py::key_error("no tree for scope " + std::to_string(scope) + " key '" + key + "'");
  return *t;
}

py::tuple draft_tuple(const Draft& d) {
  py::array_t<int32_t> toks(d.tokens.size());
  py::array_t<float> probs(d.probs.size());
  if (!d.tokens.empty()) {
    std::memcpy(toks.mutable_data(), d.tokens.data(), d.tokens.size() * 4);
    std::memcpy(probs.mutable_data(), d.probs.data(), d.probs.size() * 4);
  }
  return py::make_tuple(toks, probs, d.score, d.match_len);
}

template <typename T>
py::array_t<T, py::array::c_style | py::array::forcecast> dense(const py::handle& obj, int ndim,
                                                                const char* what) {
  auto a = py::array_t<T, py::array::c_style | py::array::forcecast>::ensure(obj);
  if (!a || a.ndim() != ndim)
    throw py::value_error(std::string(what) + " must be a " + std::to_string(ndim) + "-D numeric array");
  return a;
}

// F's table: 1-D (one row for every depth) or 2-D (a row per depth bucket), at least 1 point.
py::array_t<float, py::array::c_style | py::array::forcecast> table_of(const py::handle& f) {
  auto a = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(f);
  if (!a || (a.ndim() != 1 && a.ndim() != 2) || a.size() < 1)
    throw py::value_error("F must be a non-empty 1-D table or a 2-D table (one row per depth bucket)");
  if (a.ndim() == 1) a = a.reshape({static_cast<py::ssize_t>(1), a.shape(0)});
  return a;
}

py::tuple select_result(const SelectResult& r) {
  return py::make_tuple(r.n, r.evaluations, r.objective, r.al);
}

// A built history tree waiting to be installed (moved into the index by install_history).
struct HistoryTree {
  std::unique_ptr<SuffixTree> tree;
};

}  // namespace

PYBIND11_MODULE(_suffix, m) {
  m.doc() = "Native suffix-tree draft index (see verl_ext/spec/csrc/*.h)";
  m.attr("SCOPE_REQUEST") = static_cast<int>(kScopeRequest);
  m.attr("SCOPE_GROUP") = static_cast<int>(kScopeGroup);
  m.attr("SCOPE_HISTORY") = static_cast<int>(kScopeHistory);
  m.attr("SCOPE_GLOBAL") = static_cast<int>(kScopeGlobal);
  m.attr("NODE_BYTES") = sizeof(Node);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const std::invalid_argument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const std::out_of_range& e) {
      PyErr_SetString(PyExc_KeyError, e.what());
    } catch (const std::length_error& e) {
      PyErr_SetString(PyExc_MemoryError, e.what());
    } catch (const std::logic_error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });

  py::class_<HistoryTree>(m, "HistoryTree",
                          "A history tree built by build_history, to install into an index.")
      .def_property_readonly("tokens",
                             [](const HistoryTree& t) { return t.tree ? t.tree->num_tokens() : 0; })
      .def_property_readonly("bytes",
                             [](const HistoryTree& t) { return t.tree ? t.tree->memory_bytes() : 0; })
      .def_property_readonly("installed", [](const HistoryTree& t) { return !t.tree; });

  m.def(
      "build_history",
      [](int max_depth, py::sequence responses, py::sequence weights) {
        if (py::len(responses) != py::len(weights))
          throw py::value_error("build_history needs one weight per response");
        std::vector<Tokens> held;  // keeps the arrays alive while the GIL is released
        held.reserve(py::len(responses));
        std::vector<std::pair<const int32_t*, size_t>> rows;
        std::vector<float> ws;
        for (size_t i = 0; i < py::len(responses); ++i) {
          held.push_back(tokens_of(responses[i], "response"));  // a move keeps ptr valid
          rows.emplace_back(held.back().ptr, held.back().n);
          ws.push_back(weights[i].cast<float>());
        }
        HistoryTree out;
        {
          py::gil_scoped_release free;  // the build touches no Python object
          out.tree = build_history_tree(max_depth, rows, ws);
        }
        return out;
      },
      py::arg("max_depth"), py::arg("responses"), py::arg("weights"),
      "A history tree of the responses (token arrays) with their weights, built with the GIL "
      "released: run it on a thread of its own, then DraftIndex.install_history.");

  py::class_<DraftIndex>(m, "DraftIndex")
      .def(py::init<int, int64_t, int>(), py::arg("max_depth"), py::arg("max_bytes"),
           py::arg("max_draft"))
      .def_property_readonly("max_depth", &DraftIndex::max_depth)
      .def_property_readonly("max_draft", &DraftIndex::max_draft)
      .def_property("max_bytes", &DraftIndex::max_bytes, &DraftIndex::set_max_bytes)
      .def("start_request",
           [](DraftIndex& s, const std::string& req, py::handle prompt, const std::string& group,
              const std::string& history, int scopes, bool group_write, const std::string& group_seq,
              size_t group_offset) {
             Tokens t = tokens_of(prompt, "prompt");
             s.start_request(req, t.ptr, t.n, group, history, scopes, group_write, group_seq,
                             group_offset);
           },
           py::arg("req"), py::arg("prompt"), py::arg("group") = "", py::arg("history") = "",
           py::arg("scopes") = static_cast<int>(kScopeAll), py::arg("group_write") = true,
           py::arg("group_seq") = "", py::arg("group_offset") = 0,
           "Start a request. group_write=False: it drafts from its group tree but adds no "
           "sequence to it (the tree is imported from a grouped draft server). group_seq: write "
           "into that named sequence of the group tree from token group_offset on, merging with "
           "imports of the same response (see DraftIndex::start_request).")
      .def("has_request", &DraftIndex::has_request)
      .def("append",
           [](DraftIndex& s, const std::string& req, py::handle toks) {
             Tokens t = tokens_of(toks, "tokens");
             s.append(req, t.ptr, t.n);
           })
      .def("sync_rows",
           [](DraftIndex& s, const std::vector<std::string>& keys, py::sequence rows, py::handle ends) {
             auto en = dense<int64_t>(ends, 1, "ends");
             const size_t b = keys.size();
             if (static_cast<size_t>(py::len(rows)) != b || static_cast<size_t>(en.shape(0)) != b)
               throw py::value_error("sync_rows: keys, rows and ends differ in length");
             for (size_t i = 0; i < b; ++i) {
               const size_t have = s.context_length(keys[i]);
               const int64_t end = en.data()[i];
               if (end <= static_cast<int64_t>(have)) continue;
               auto row = py::array_t<int32_t, py::array::c_style | py::array::forcecast>::ensure(rows[i]);
               if (!row || row.ndim() != 1 || end > row.shape(0))
                 throw py::value_error("sync_rows: row " + std::to_string(i) + " must be a 1-D token array of at least ends[i] tokens");
               const int32_t* toks = row.data() + have;  // row[have:end], read in place
               const size_t n = static_cast<size_t>(end) - have;
               check_ids(toks, n, "tokens");
               s.append(keys[i], toks, n);
             }
           },
           py::arg("keys"), py::arg("rows"), py::arg("ends"),
           "For each request in order, append rows[i][context_length:ends[i]] (nothing where its "
           "context already reaches ends[i]): the engine batch's tokens so far, before its proposals.")
      .def("finish", &DraftIndex::finish)
      .def("context_length", &DraftIndex::context_length)
      .def("group_append",
           [](DraftIndex& s, const std::string& g, const std::string& seq, py::handle toks) {
             Tokens t = tokens_of(toks, "tokens");
             s.group_append(g, seq, t.ptr, t.n);
           })
      .def("group_close", &DraftIndex::group_close)
      .def("drop_group", &DraftIndex::drop_group)
      .def("group_counts", &DraftIndex::group_counts, py::arg("group"),
           "(closed sequences, all sequences) of a group tree; (0, 0) for an unknown group.")
      .def("group_version", &DraftIndex::group_version, py::arg("group"),
           "The group tree's current version (as export_group returns it); 0 if unknown.")
      .def("group_sequence", &DraftIndex::group_sequence, py::arg("group"), py::arg("seq"),
           "(length, closed) of one sequence of a group tree; (0, False) when absent.")
      .def("add_history",
           [](DraftIndex& s, const std::string& key, py::handle toks, float w) {
             Tokens t = tokens_of(toks, "tokens");
             s.add_history(key, t.ptr, t.n, w);
           },
           py::arg("key"), py::arg("tokens"), py::arg("weight") = 1.0f)
      .def("drop_history", &DraftIndex::drop_history)
      .def("set_global_tokens", &DraftIndex::set_global_tokens, py::arg("tokens"),
           "Turn the global scope on with `tokens` per generation of its tree (0: off, drops it).")
      .def_property_readonly("global_tokens", &DraftIndex::global_tokens)
      .def("add_global",
           [](DraftIndex& s, py::handle toks, float w) {
             Tokens t = tokens_of(toks, "tokens");
             s.add_global(t.ptr, t.n, w);
           },
           py::arg("tokens"), py::arg("weight") = 1.0f,
           "Add a response to the global tree (finished requests with the global scope add theirs).")
      .def("install_history",
           [](DraftIndex& s, const std::string& key, HistoryTree& t) {
             s.install_history(key, std::move(t.tree));
           },
           py::arg("key"), py::arg("tree"),
           "Replace key's history tree by a HistoryTree from build_history (O(1)); the tree "
           "object is empty afterwards.")
      .def("propose",
           [](DraftIndex& s, const std::string& req, int k, py::object context, int scopes,
              int min_match, int max_match, float min_prob, bool scope_weights) {
             DraftParams p = params(min_match, max_match, min_prob, scope_weights);
             static const int32_t kNoTokens = 0;  // non-null: an empty context, not "stored"
             Tokens t;
             if (!context.is_none()) t = tokens_of(context, "context");
             const int32_t* ctx = context.is_none() ? nullptr : (t.n ? t.ptr : &kNoTokens);
             Proposal pr = s.propose(req, ctx, t.n, k, scopes, p);
             return py::make_tuple(draft_tuple(pr.draft), pr.scope);
           },
           py::arg("req"), py::arg("k"), py::arg("context") = py::none(), py::arg("scopes") = static_cast<int>(kScopeAll),
           py::arg("min_match") = 1, py::arg("max_match") = 16, py::arg("min_prob") = 0.3f, py::arg("scope_weights") = false)
      .def("batch_propose",
           [](DraftIndex& s, const std::vector<std::string>& keys, py::object ks,
              py::object rows, py::object lens, int scopes, int min_match, int max_match,
              float min_prob, bool sync, bool scope_weights) {
             const size_t b = keys.size();
             Batch x = batch_of(b, ks, rows, lens, s.max_draft());
             int64_t kmax = 0;
             for (size_t i = 0; i < b; ++i) kmax = std::max(kmax, x.ks.data()[i]);
             py::array_t<int32_t> toks({static_cast<py::ssize_t>(b), static_cast<py::ssize_t>(kmax)});
             py::array_t<float> probs({static_cast<py::ssize_t>(b), static_cast<py::ssize_t>(kmax)});
             py::array_t<int32_t> n(b);
             py::array_t<int8_t> scope(b);
             int32_t* tp = toks.mutable_data();
             float* pp = probs.mutable_data();
             std::fill(tp, tp + b * kmax, -1);
             std::fill(pp, pp + b * kmax, 0.0f);
             int32_t* np_ = n.mutable_data();
             int8_t* sp = scope.mutable_data();
             run_batch(s, keys, x, scopes, params(min_match, max_match, min_prob, scope_weights), sync,
                       [&](size_t i, const Proposal& pr) {
                         const size_t l = pr.draft.tokens.size();
                         std::copy(pr.draft.tokens.begin(), pr.draft.tokens.end(), tp + i * kmax);
                         std::copy(pr.draft.probs.begin(), pr.draft.probs.end(), pp + i * kmax);
                         np_[i] = static_cast<int32_t>(l);
                         sp[i] = static_cast<int8_t>(pr.scope);
                       });
             return py::make_tuple(toks, n, probs, scope);
           },
           py::arg("keys"), py::arg("ks"), py::arg("token_rows") = py::none(),
           py::arg("lens") = py::none(), py::arg("scopes") = static_cast<int>(kScopeAll), py::arg("min_match") = 1,
           py::arg("max_match") = 16, py::arg("min_prob") = 0.3f, py::arg("sync") = true,
           py::arg("scope_weights") = false)
      .def("batch_propose_lists",
           [](DraftIndex& s, const std::vector<std::string>& keys, py::object ks,
              py::object rows, py::object lens, int scopes, int min_match, int max_match,
              float min_prob, bool sync, bool scope_weights) {
             Batch x = batch_of(keys.size(), ks, rows, lens, s.max_draft());
             py::list out(keys.size());
             run_batch(s, keys, x, scopes, params(min_match, max_match, min_prob, scope_weights), sync,
                       [&](size_t i, const Proposal& pr) {
                         py::list d(pr.draft.tokens.size());
                         for (size_t j = 0; j < pr.draft.tokens.size(); ++j)
                           d[j] = py::int_(pr.draft.tokens[j]);
                         out[i] = std::move(d);
                       });
             return out;
           },
           py::arg("keys"), py::arg("ks"), py::arg("token_rows") = py::none(),
           py::arg("lens") = py::none(), py::arg("scopes") = static_cast<int>(kScopeAll), py::arg("min_match") = 1,
           py::arg("max_match") = 16, py::arg("min_prob") = 0.3f, py::arg("sync") = true,
           py::arg("scope_weights") = false)
      .def("replay",
           [](DraftIndex& s, const std::vector<std::string>& keys, py::sequence rows,
              const std::vector<int64_t>& starts, const std::vector<int64_t>& ends, int k,
              int scopes, int min_match, int max_match, float min_prob, int64_t max_steps,
              int aimd_start, int aimd_step, bool scope_weights) {
             const size_t n = keys.size();
             if (static_cast<size_t>(py::len(rows)) != n || starts.size() != n || ends.size() != n)
               throw py::value_error("replay: keys, rows, starts and ends differ in length");
             if (aimd_start < 0 || aimd_step < 0) throw py::value_error("aimd_start and aimd_step must be >= 0");
             std::vector<Tokens> held(n);
             std::vector<const int32_t*> ptrs(n);
             std::vector<size_t> st(n), en(n);
             for (size_t i = 0; i < n; ++i) {
               held[i] = tokens_of(rows[i], "row");
               if (starts[i] < 0 || ends[i] < starts[i] || static_cast<size_t>(ends[i]) > held[i].n)
                 throw py::value_error("replay: row " + std::to_string(i) + " needs 0 <= start <= end <= len(row)");
               ptrs[i] = held[i].ptr;
               st[i] = static_cast<size_t>(starts[i]);
               en[i] = static_cast<size_t>(ends[i]);
             }
             std::vector<std::vector<int32_t>> emitted, drafted;
             s.replay(keys, ptrs, st, en, k, scopes, params(min_match, max_match, min_prob, scope_weights),
                      max_steps, &emitted, &drafted, AimdParams{aimd_start, aimd_step});
             py::list out(n);
             for (size_t i = 0; i < n; ++i) {
               py::array_t<int32_t> e(emitted[i].size()), d(drafted[i].size());
               std::copy(emitted[i].begin(), emitted[i].end(), e.mutable_data());
               std::copy(drafted[i].begin(), drafted[i].end(), d.mutable_data());
               out[i] = py::make_tuple(e, d);
             }
             return out;
           },
           py::arg("keys"), py::arg("rows"), py::arg("starts"), py::arg("ends"), py::arg("k"),
           py::arg("scopes") = static_cast<int>(kScopeAll), py::arg("min_match") = 1, py::arg("max_match") = 16,
           py::arg("min_prob") = 0.3f, py::arg("max_steps") = -1, py::arg("aimd_start") = 0,
           py::arg("aimd_step") = 2, py::arg("scope_weights") = false,
           "Exact-match replay for the simulator: each request decodes along its row from start "
           "to end (at most max_steps steps; < 0: no limit), drafting up to k tokens per step "
           "(aimd_start > 0: up to its AIMD window, RhymeRL section 5.4); returns [(emitted per "
           "step, drafted per step)] (see DraftIndex::replay in draft_index.h).")
      .def("propose_paths",
           [](const DraftIndex& s, int scope, const std::string& key, py::handle context, int k,
              int num_paths, int min_match, int max_match, float min_prob) {
             if (k < 0 || k > s.max_draft()) throw py::value_error("k is outside [0, max_draft]");
             DraftParams p = params(min_match, max_match, min_prob);
             py::list out;
             const SuffixTree* t = s.tree(scope, key);
             Tokens c = tokens_of(context, "context");
             if (!t || c.n == 0) return out;
             for (const Draft& d :
                  t->propose_paths(c.ptr, c.n, k, p.min_match, p.max_match, p.min_prob, num_paths))
               out.append(draft_tuple(d));
             return out;
           },
           py::arg("scope"), py::arg("key"), py::arg("context"), py::arg("k"),
           py::arg("num_paths"), py::arg("min_match") = 1, py::arg("max_match") = 16,
           py::arg("min_prob") = 0.3f)
      .def("tree_propose",
           [](const DraftIndex& s, int scope, const std::string& key, py::handle context, int k,
              int min_match, int max_match, float min_prob) {
             if (k < 0 || k > s.max_draft()) throw py::value_error("k is outside [0, max_draft]");
             DraftParams p = params(min_match, max_match, min_prob);
             const SuffixTree* t = s.tree(scope, key);
             Tokens c = tokens_of(context, "context");
             Draft d;
             if (t && c.n) d = t->propose(c.ptr, c.n, k, p.min_match, p.max_match, p.min_prob);
             return draft_tuple(d);
           },
           py::arg("scope"), py::arg("key"), py::arg("context"), py::arg("k"),
           py::arg("min_match") = 1, py::arg("max_match") = 16, py::arg("min_prob") = 0.3f)
      .def("priority",
           [](const DraftIndex& s, int scope, const std::string& key, py::handle toks) {
             Tokens t = tokens_of(toks, "tokens");
             return tree_of(s, scope, key).priority(t.ptr, t.n);
           })
      .def("dump",
           [](const DraftIndex& s, int scope, const std::string& key) {
             py::dict d;
             for (auto& [path, prio] : tree_of(s, scope, key).dump())
               d[py::tuple(py::cast(path))] = prio;
             return d;
           })
      .def("tree_bytes",
           [](const DraftIndex& s, int scope, const std::string& key) {
             const SuffixTree& t = tree_of(s, scope, key);
             return py::make_tuple(t.memory_bytes(), t.num_tokens(), t.num_nodes());
           })
      .def("export_group",
           [](DraftIndex& s, const std::string& g, uint64_t since) {
             uint64_t v = 0;
             std::string blob = s.export_group(g, since, &v);
             return py::make_tuple(py::bytes(blob), v);
           },
           py::arg("group"), py::arg("since") = 0)
      .def("import_group",
           [](DraftIndex& s, py::bytes blob, const std::string& rename) {
             return s.import_group(std::string(blob), rename);
           },
           py::arg("blob"), py::arg("rename") = "")
      .def("save", [](const DraftIndex& s, int scopes) { return py::bytes(s.save(scopes)); },
           py::arg("scopes") = kScopeGroup | kScopeHistory)
      .def("load", [](DraftIndex& s, py::bytes blob) { return s.load(std::string(blob)); })
      .def("stats",
           [](const DraftIndex& s) {
             IndexStats x = s.stats();
             py::dict d;
             d["requests"] = x.requests;
             d["groups"] = x.groups;
             d["histories"] = x.histories;
             d["nodes"] = x.nodes;
             d["tokens"] = x.tokens;
             d["bytes"] = x.bytes;
             d["evictions"] = x.evictions;
             d["walks_skipped"] = x.walks_skipped;
             d["global_tokens_held"] = x.global_tokens_held;
             d["scope_stats"] = x.scope_stats;
             d["max_bytes"] = s.max_bytes();
             return d;
           })
      .def("clear", &DraftIndex::clear);

  m.def(
      "select_chains",
      [](py::handle scores, py::handle lens, py::handle f, py::handle t, double base, int patience) {
        auto sc = dense<float>(scores, 2, "scores");
        auto ln = dense<int32_t>(lens, 1, "lens");
        auto fa = table_of(f);
        auto ta = dense<double>(t, 1, "t");
        const int64_t rows = sc.shape(0), width = sc.shape(1);
        if (ln.shape(0) != rows) throw py::value_error("select_chains: one length per row of scores");
        for (int64_t i = 0; i < rows; ++i)
          if (ln.data()[i] < 0 || ln.data()[i] > width)
            throw py::value_error("select_chains: lens must be in [0, scores.shape[1]]");
        if (patience < 0) throw py::value_error("patience must be >= 0 (0 = exhaustive)");
        SelectResult r = select_chains(sc.data(), rows, width, ln.data(), fa.data(),
                                       static_cast<int>(fa.shape(1)), static_cast<int>(fa.shape(0)),
                                       ta.data(), ta.shape(0), base, patience);
        py::array_t<int32_t> caps(rows);
        int32_t* c = caps.mutable_data();
        std::fill(c, c + rows, 0);
        for (int64_t k = 0; k < r.n; ++k) c[r.order[k] / width] += 1;
        return py::make_tuple(caps, select_result(r));
      },
      py::arg("scores"), py::arg("lens"), py::arg("F"), py::arg("t"), py::arg("base"),
      py::arg("patience") = 0,
      "RLHFSpec layer-level search over linear drafts (see draft_select.h): (draft length per "
      "row, (n, evaluations, objective, al)).");
  m.def(
      "isotonic_rows",
      [](py::handle y, py::handle w) {
        auto ya = dense<double>(y, 2, "y");
        auto wa = dense<double>(w, 2, "w");
        if (ya.shape(0) != wa.shape(0) || ya.shape(1) != wa.shape(1))
          throw py::value_error("isotonic_rows: y and w must have the same shape");
        const int64_t rows = ya.shape(0), n = ya.shape(1);
        py::array_t<double> out({rows, n});
        double* o = out.mutable_data();
        for (int64_t i = 0; i < rows; ++i) isotonic_fit(ya.data() + i * n, wa.data() + i * n, n, o + i * n);
        return out;
      },
      py::arg("y"), py::arg("w"),
      "Per row of y (2-D), the non-decreasing weighted least-squares fit with weights w "
      "(pool-adjacent-violators; F's refit in RLHFSpec's selector).");
  m.def(
      "observe_chains",
      [](py::handle scores, py::handle drafted, py::handle accepted, py::array_t<double> seen,
         py::array_t<double> acc, double window) {
        auto sc = dense<float>(scores, 2, "scores");
        auto dr = dense<int64_t>(drafted, 1, "drafted");
        auto ac = dense<int64_t>(accepted, 1, "accepted");
        const int64_t rows = sc.shape(0), width = sc.shape(1);
        if (dr.shape(0) != rows || ac.shape(0) != rows)
          throw py::value_error("observe_chains: one drafted and one accepted count per row of scores");
        for (auto* a : {&seen, &acc})
          if (a->ndim() != 2 || a->shape(0) != kDepthBuckets || a->shape(1) < 2 ||
              !(a->flags() & py::array::c_style) || !a->writeable())
            throw py::value_error("observe_chains: seen and accepted must be writeable C-contiguous float64 "
                                  "arrays of one row per depth bucket");
        if (seen.shape(1) != acc.shape(1)) throw py::value_error("observe_chains: seen and accepted differ in shape");
        if (!(window > 0)) throw py::value_error("observe_chains: window must be > 0");
        observe_chains(sc.data(), rows, width, dr.data(), ac.data(), static_cast<int>(seen.shape(1)), window,
                       seen.mutable_data(), acc.mutable_data());
      },
      py::arg("scores"), py::arg("drafted"), py::arg("accepted"), py::arg("seen"), py::arg("acc"), py::arg("window"),
      "F's online counts from one step's linear drafts, in place (see draft_select.h).");
  m.def(
      "acceptance_table",
      [](py::handle accepted, py::handle seen, py::handle prior, double prior_weight) {
        auto ac = dense<double>(accepted, 2, "accepted");
        auto se = dense<double>(seen, 2, "seen");
        auto pr = dense<double>(prior, 2, "prior");
        const int64_t rows = ac.shape(0), points = ac.shape(1);
        if (se.shape(0) != rows || se.shape(1) != points || pr.shape(0) != rows || pr.shape(1) != points)
          throw py::value_error("acceptance_table: accepted, seen and prior must have the same shape");
        py::array_t<float> out({rows, points});
        acceptance_table(ac.data(), se.data(), pr.data(), rows, points, prior_weight, out.mutable_data());
        return out;
      },
      py::arg("accepted"), py::arg("seen"), py::arg("prior"), py::arg("prior_weight"),
      "F's table from its counts and prior (see draft_select.h).");
  m.def(
      "cumulative_scores",
      [](py::handle probs, py::handle lens) {
        auto pa = dense<float>(probs, 2, "probs");
        auto ln = dense<int32_t>(lens, 1, "lens");
        const int64_t rows = pa.shape(0), width = pa.shape(1);
        if (ln.shape(0) != rows) throw py::value_error("cumulative_scores: one length per row of probs");
        py::array_t<float> out({rows, width});
        cumulative_scores(pa.data(), rows, width, ln.data(), out.mutable_data());
        return out;
      },
      py::arg("probs"), py::arg("lens"),
      "Cumulative draft scores: running float32 products of each row's first lens[i] probabilities, 0 after.");
  m.def(
      "match_lengths",
      [](py::handle drafts, py::handle limits, py::sequence rows, py::handle positions) {
        auto dr = dense<int32_t>(drafts, 2, "drafts");
        auto li = dense<int64_t>(limits, 1, "limits");
        auto po = dense<int64_t>(positions, 1, "positions");
        const int64_t b = dr.shape(0), width = dr.shape(1);
        if (li.shape(0) != b || po.shape(0) != b || static_cast<int64_t>(py::len(rows)) != b)
          throw py::value_error("match_lengths: one limit, row and position per row of drafts");
        py::array_t<int64_t> out(b);
        int64_t* o = out.mutable_data();
        for (int64_t i = 0; i < b; ++i) {
          const int64_t m = li.data()[i], p = po.data()[i];
          o[i] = 0;
          if (m <= 0) continue;
          auto row = py::array_t<int32_t, py::array::c_style | py::array::forcecast>::ensure(rows[i]);
          if (!row || row.ndim() != 1 || m > width || p < 0 || p + m > row.shape(0))
            throw py::value_error("match_lengths: row " + std::to_string(i) + " needs limits[i] <= drafts.shape[1] "
                                  "and positions[i] + limits[i] <= len(rows[i])");
          const int32_t* d = dr.data() + i * width;
          const int32_t* r = row.data() + p;
          int64_t a = 0;
          while (a < m && d[a] == r[a]) ++a;
          o[i] = a;
        }
        return out;
      },
      py::arg("drafts"), py::arg("limits"), py::arg("rows"), py::arg("positions"),
      "Exact-match verification (the simulator): per row i, how many of drafts[i, :limits[i]] "
      "equal rows[i][positions[i]:] before the first difference.");
  m.def(
      "select_tree",
      [](py::handle parents, py::handle scores, py::handle f, py::handle t, double base, int patience) {
        auto pa = dense<int32_t>(parents, 1, "parents");
        auto sc = dense<float>(scores, 1, "scores");
        auto fa = table_of(f);
        auto ta = dense<double>(t, 1, "t");
        const int64_t n = pa.shape(0);
        if (sc.shape(0) != n) throw py::value_error("select_tree: one score per node");
        for (int64_t u = 0; u < n; ++u)
          if (pa.data()[u] >= n) throw py::value_error("select_tree: parent index out of range");
        if (patience < 0) throw py::value_error("patience must be >= 0 (0 = exhaustive)");
        SelectResult r = select_tree(pa.data(), sc.data(), n, fa.data(), static_cast<int>(fa.shape(1)),
                                     static_cast<int>(fa.shape(0)), ta.data(), ta.shape(0), base, patience);
        py::array_t<bool> mask(n);
        bool* mk = mask.mutable_data();
        std::fill(mk, mk + n, false);
        for (int64_t k = 0; k < r.n; ++k) mk[r.order[k]] = true;
        return py::make_tuple(mask, select_result(r));
      },
      py::arg("parents"), py::arg("scores"), py::arg("F"), py::arg("t"), py::arg("base"),
      py::arg("patience") = 0,
      "RLHFSpec layer-level search over a draft forest (tree verification): (selected node mask, "
      "(n, evaluations, objective, al)).");
}
