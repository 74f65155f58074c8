#include "grammar/json_schema_compiler.h"

#include <algorithm>
#include <array>
#include <bitset>
#include <cmath>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/json_parse.h"

namespace mobius::grammar {
namespace {

using Json = nlohmann::ordered_json;
using ByteSet = std::bitset<256>;

// A compiled schema must stay small: each node costs the matcher nothing, but a hostile schema
// could otherwise expand without bound through nested definitions.
constexpr size_t kMaxNodes = 4096;
constexpr int kMaxSchemaDepth = 64;

// Keywords that only describe (JSON Schema's annotations; format is one too, but the string
// formats of FormatPattern are enforced).
const std::set<std::string>& IgnoredKeywords() {
  static const std::set<std::string> kIgnored = {
      "$schema",         "$id",     "$comment", "$anchor",      "title",
      "description",     "default", "examples", "deprecated",   "readOnly",
      "writeOnly",       "format",  "$defs",    "definitions",  "contentMediaType",
      "contentEncoding", "strict",  "name",     "discriminator"};
  return kIgnored;
}

// Validation keywords this compiler does not implement: refused by name.
const std::set<std::string>& UnsupportedKeywords() {
  static const std::set<std::string> kUnsupported = {"patternProperties",
                                                     "multipleOf",
                                                     "uniqueItems",
                                                     "contains",
                                                     "minContains",
                                                     "maxContains",
                                                     "prefixItems",
                                                     "minProperties",
                                                     "maxProperties",
                                                     "propertyNames",
                                                     "dependentRequired",
                                                     "dependentSchemas",
                                                     "dependencies",
                                                     "if",
                                                     "then",
                                                     "else",
                                                     "not",
                                                     "unevaluatedProperties",
                                                     "unevaluatedItems",
                                                     "additionalItems",
                                                     "$dynamicRef",
                                                     "$recursiveRef"};
  return kUnsupported;
}

// The formats OpenAI's structured outputs enforce on strings, as whole-string patterns (RFC 3339
// dates and times, RFC 4122 UUIDs, dotted IPv4, an address with one '@', RFC 1123 host names).
// Empty for other formats, which stay annotations.
std::string FormatPattern(const std::string& format) {
  static const std::map<std::string, std::string> kPatterns = [] {
    const std::string date = "\\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\\d|3[01])";
    const std::string time =
        "([01]\\d|2[0-3]):[0-5]\\d:([0-5]\\d|60)(\\.\\d{1,9})?(Z|[+-]([01]\\d|2[0-3]):[0-5]\\d)";
    const std::string octet = "(25[0-5]|2[0-4]\\d|1\\d\\d|[1-9]?\\d)";
    const std::string label = "[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?";
    return std::map<std::string, std::string>{
        {"date", "^" + date + "$"},
        {"time", "^" + time + "$"},
        {"date-time", "^" + date + "T" + time + "$"},
        {"uuid", "^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"},
        {"ipv4", "^(" + octet + "\\.){3}" + octet + "$"},
        {"email", "^[A-Za-z0-9._%+-]{1,64}@" + label + "(\\." + label + ")*$"},
        {"hostname", "^" + label + "(\\." + label + ")*$"},
    };
  }();
  auto it = kPatterns.find(format);
  return it == kPatterns.end() ? std::string() : it->second;
}

Node LiteralsNode(std::vector<std::string> literals) {
  Node n(NodeKind::kLiterals);
  n.literals = std::move(literals);
  return n;
}

Node ObjectOf(int32_t additional) {
  Node n(NodeKind::kObject);
  n.additional = additional;
  return n;
}

Node ArrayOf(int32_t items) {
  Node n(NodeKind::kArray);
  n.items = items;
  return n;
}

// Appends `node` to `g`; its index.
int32_t AddNode(Grammar& g, Node node) {
  g.nodes.push_back(std::move(node));
  return static_cast<int32_t>(g.nodes.size() - 1);
}

// The JSON text of a string, as it appears in output (quotes and escapes, UTF-8 kept).
std::string QuotedJson(const std::string& s) { return Json(s).dump(); }

// The bytes a value of each node can start with, and how many matcher frames (nesting levels)
// its shortest complete value needs: both as fixed points over the node graph (unions and
// references make it cyclic), each node visited a bounded number of times.
void ComputeFirstBytesAndDepths(Grammar& g) {
  const size_t n = g.nodes.size();
  g.first_bytes.assign(n, ByteSet());
  constexpr int32_t kUnreachable = 1 << 20;
  g.min_depth.assign(n, kUnreachable);
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t i = 0; i < n; ++i) {
      const Node& node = g.nodes[i];
      ByteSet set;
      int32_t depth = kUnreachable;
      switch (node.kind) {
        case NodeKind::kObject: {
          set.set('{');
          depth = 1;
          for (const Property& p : node.properties) {
            if (p.required) depth = std::max(depth, 1 + g.min_depth[p.value]);
          }
          break;
        }
        case NodeKind::kArray:
          set.set('[');
          depth = 1 + (node.min_items > 0 ? g.min_depth[node.items] : 0);
          break;
        case NodeKind::kString:
          set.set('"');
          depth = 1;
          break;
        case NodeKind::kNumber:
        case NodeKind::kInteger:
          set.set('-');
          for (char c = '0'; c <= '9'; ++c) set.set(static_cast<unsigned char>(c));
          depth = 1;
          break;
        case NodeKind::kLiterals:
          for (const std::string& l : node.literals) {
            if (!l.empty()) set.set(static_cast<unsigned char>(l[0]));
          }
          depth = 1;
          break;
        case NodeKind::kUnion:
          // A union takes no frame of its own: the alternative chosen does.
          for (int32_t a : node.alternatives) {
            set |= g.first_bytes[a];
            depth = std::min(depth, g.min_depth[a]);
          }
          break;
        case NodeKind::kUntil:
          set.set();  // any byte: free text
          depth = 1;
          break;
        case NodeKind::kRegex:
          set = g.regexes[node.regex].FirstBytes();
          depth = 1;
          break;
        case NodeKind::kObjectSwitch:
          // The frame becomes one of the objects; it is entered only if every one could finish.
          set.set('{');
          depth = 1;
          for (int32_t a : node.alternatives) depth = std::max(depth, g.min_depth[a]);
          break;
        case NodeKind::kRepeat:
          set = g.first_bytes[node.items];
          depth = 1 + g.min_depth[node.items];
          break;
        case NodeKind::kSequence:
          // Every node consumes at least one byte, so a sequence starts as its first part does.
          if (!node.alternatives.empty()) set = g.first_bytes[node.alternatives[0]];
          depth = 1;
          for (int32_t part : node.alternatives) depth = std::max(depth, 1 + g.min_depth[part]);
          break;
      }
      depth = std::min(depth, kUnreachable);
      if (set != g.first_bytes[i] || depth != g.min_depth[i]) {
        g.first_bytes[i] |= set;
        g.min_depth[i] = std::min(g.min_depth[i], depth);
        changed = true;
      }
    }
  }
}

// Fills first_bytes and min_depth and checks what the matcher relies on: every union's
// alternatives start differently (it picks one by its first byte and never backtracks), every
// node can start and finish, and the shortest value fits the matcher's depth.
absl::Status FinishGrammar(Grammar& g) {
  ComputeFirstBytesAndDepths(g);
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    if (g.first_bytes[i].none() || g.min_depth[i] > kMaxNestingDepth) {
      return absl::InvalidArgumentError(
          g.first_bytes[i].none()
              ? "schema: a part of it admits no value (a reference or union that only leads "
                "back to itself)"
              : absl::StrCat("schema: its values nest deeper than ", kMaxNestingDepth,
                             " levels, the most the matcher keeps"));
    }
    const Node& node = g.nodes[i];
    if (node.kind != NodeKind::kUnion) continue;
    ByteSet seen;
    for (int32_t a : node.alternatives) {
      if ((g.first_bytes[a] & seen).any()) {
        return absl::InvalidArgumentError(
            "schema: anyOf / oneOf / a list of types must offer alternatives that start "
            "differently (different JSON types: object, array, string, number, boolean, null, "
            "or objects told apart by their first property's const values); two alternatives "
            "here can start with the same character, or one leads back to the union itself");
      }
      seen |= g.first_bytes[a];
    }
  }
  return absl::OkStatus();
}

class SchemaCompiler {
 public:
  explicit SchemaCompiler(const Json& root) : root_(root) {}

  absl::StatusOr<Grammar> Compile() {
    grammar_.string_node = Add(Node(NodeKind::kString));
    absl::StatusOr<int32_t> root = CompileNode(root_, "schema", 0);
    if (!root.ok()) return root.status();
    grammar_.root = *root;
    if (absl::Status s = FinishGrammar(grammar_); !s.ok()) return s;
    return std::move(grammar_);
  }

 private:
  int32_t Add(Node node) { return AddNode(grammar_, std::move(node)); }

  static absl::Status Error(const std::string& path, const std::string& reason) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", reason));
  }

  absl::StatusOr<int32_t> CompileNode(const Json& s, const std::string& path, int depth) {
    if (depth > kMaxSchemaDepth) return Error(path, "schema nested too deeply");
    if (grammar_.nodes.size() > kMaxNodes) return Error(path, "schema too large");
    if (s.is_boolean()) {
      if (!s.get<bool>()) return Error(path, "the schema false admits no value");
      return AddAnyValue(grammar_);
    }
    if (!s.is_object()) return Error(path, "a schema must be an object or a boolean");
    for (const auto& [key, value] : s.items()) {
      if (UnsupportedKeywords().count(key)) {
        return Error(absl::StrCat(path, ".", key),
                     "this keyword is not supported in structured output");
      }
    }
    if (auto ref = s.find("$ref"); ref != s.end()) {
      if (s.size() > 1) {
        for (const auto& [key, value] : s.items()) {
          if (key != "$ref" && !IgnoredKeywords().count(key)) {
            return Error(absl::StrCat(path, ".", key), "keywords beside $ref are not supported");
          }
        }
      }
      return CompileRef(*ref, path + ".$ref", depth);
    }
    if (auto all = s.find("allOf"); all != s.end()) {
      if (!all->is_array() || all->size() != 1 || s.size() > 1 + CountIgnored(s)) {
        return Error(path + ".allOf", "only an allOf of one schema, alone, is supported");
      }
      return CompileNode((*all)[0], path + ".allOf[0]", depth + 1);
    }
    for (const char* word : {"anyOf", "oneOf"}) {
      if (auto any = s.find(word); any != s.end()) {
        const std::string at = absl::StrCat(path, ".", word);
        // Keywords beside the alternatives would constrain every one of them; not supported
        // rather than dropped.
        for (const auto& [key, value] : s.items()) {
          if (key != word && !IgnoredKeywords().count(key)) {
            return Error(absl::StrCat(path, ".", key),
                         absl::StrCat("keywords beside ", word,
                                      " are not supported (move them into each alternative)"));
          }
        }
        if (!any->is_array() || any->empty()) return Error(at, "must be a non-empty array");
        Node u(NodeKind::kUnion);
        for (size_t i = 0; i < any->size(); ++i) {
          absl::StatusOr<int32_t> alt =
              CompileNode((*any)[i], absl::StrCat(at, "[", i, "]"), depth + 1);
          if (!alt.ok()) return alt.status();
          u.alternatives.push_back(*alt);
        }
        if (absl::Status st = SwitchObjects(u.alternatives, at); !st.ok()) return st;
        if (u.alternatives.size() == 1) return u.alternatives[0];
        return Add(std::move(u));
      }
    }
    if (s.contains("const") || s.contains("enum")) return CompileLiterals(s, path);
    std::vector<std::string> types;
    if (auto t = s.find("type"); t != s.end()) {
      if (t->is_string()) {
        types.push_back(t->get<std::string>());
      } else if (t->is_array() && !t->empty()) {
        for (const Json& x : *t) {
          if (!x.is_string()) return Error(path + ".type", "must hold type names");
          types.push_back(x.get<std::string>());
        }
      } else {
        return Error(path + ".type", "must be a type name or a non-empty list of them");
      }
    } else if (s.contains("properties") || s.contains("required") ||
               s.contains("additionalProperties")) {
      types.push_back("object");
    } else if (s.contains("items") || s.contains("minItems") || s.contains("maxItems")) {
      types.push_back("array");
    } else if (s.contains("minLength") || s.contains("maxLength") || s.contains("pattern")) {
      types.push_back("string");
    } else if (s.contains("minimum") || s.contains("maximum") || s.contains("exclusiveMinimum") ||
               s.contains("exclusiveMaximum")) {
      types.push_back("number");
    } else {
      return AddAnyValue(grammar_);
    }
    Node u(NodeKind::kUnion);
    for (const std::string& type : types) {
      absl::StatusOr<int32_t> n = CompileTyped(s, type, path, depth);
      if (!n.ok()) return n.status();
      u.alternatives.push_back(*n);
    }
    if (u.alternatives.size() == 1) return u.alternatives[0];
    return Add(std::move(u));
  }

  // enum / const: the values that also have the schema's `type` when it gives one (pydantic
  // writes {"enum": [...], "type": "string"}); other keywords beside them are refused.
  absl::StatusOr<int32_t> CompileLiterals(const Json& s, const std::string& path) {
    const bool is_const = s.contains("const");
    const std::string word = is_const ? "const" : "enum";
    std::vector<Json> values;
    if (is_const) {
      values.push_back(s["const"]);
    } else {
      const Json& e = s["enum"];
      if (!e.is_array() || e.empty()) return Error(path + ".enum", "must be a non-empty array");
      values.assign(e.begin(), e.end());
    }
    std::vector<std::string> types;
    for (const auto& [key, value] : s.items()) {
      if (key == word || IgnoredKeywords().count(key)) continue;
      if (key != "type") {
        return Error(absl::StrCat(path, ".", key),
                     absl::StrCat("keywords beside ", word, " other than type are not supported"));
      }
      if (value.is_string()) types.push_back(value.get<std::string>());
      if (value.is_array()) {
        for (const Json& t : value) {
          if (t.is_string()) types.push_back(t.get<std::string>());
        }
      }
    }
    auto has_type = [&types](const Json& v) {
      if (types.empty()) return true;
      for (const std::string& t : types) {
        if ((t == "string" && v.is_string()) || (t == "number" && v.is_number()) ||
            (t == "integer" && v.is_number_integer()) || (t == "boolean" && v.is_boolean()) ||
            (t == "null" && v.is_null()) || (t == "object" && v.is_object()) ||
            (t == "array" && v.is_array())) {
          return true;
        }
      }
      return false;
    };
    Node lit(NodeKind::kLiterals);
    for (const Json& v : values) {
      if (has_type(v)) lit.literals.push_back(v.dump());
    }
    if (lit.literals.empty()) {
      return Error(absl::StrCat(path, ".", word), "no value has the schema's type");
    }
    return Add(std::move(lit));
  }

  // The node a chain of one-alternative unions (references) leads to.
  int32_t Resolve(int32_t node) const {
    for (size_t hops = 0; hops <= grammar_.nodes.size(); ++hops) {
      const Node& n = grammar_.nodes[node];
      if (n.kind != NodeKind::kUnion || n.alternatives.size() != 1) break;
      node = n.alternatives[0];
    }
    return node;
  }

  // Objects among a union's alternatives all start with '{', so the matcher cannot pick one by
  // its first byte. They become one kObjectSwitch when their first declared property is the
  // same required key whose const / enum values tell them apart (a discriminator, as pydantic
  // writes tagged unions: {"type": {"const": "circle"}, ...}). Objects that cannot be told
  // apart that way are refused here, with the alternative's place.
  absl::Status SwitchObjects(std::vector<int32_t>& alternatives, const std::string& at) {
    std::vector<size_t> objects;
    for (size_t i = 0; i < alternatives.size(); ++i) {
      if (grammar_.nodes[Resolve(alternatives[i])].kind == NodeKind::kObject) objects.push_back(i);
    }
    if (objects.size() < 2) return absl::OkStatus();
    auto refuse = [&at](size_t i, const std::string& why) {
      return Error(absl::StrCat(at, "[", i, "]"),
                   absl::StrCat("objects among the alternatives must share a required first "
                                "property whose const or enum values tell them apart (such as "
                                "\"type\"): ",
                                why));
    };
    Node sw(NodeKind::kObjectSwitch);
    Node values(NodeKind::kLiterals);
    std::map<std::string, size_t> owner;  // literal -> the alternative it selects
    std::string key;
    for (size_t i : objects) {
      const int32_t object = Resolve(alternatives[i]);
      const Node& o = grammar_.nodes[object];
      if (o.properties.empty()) return refuse(i, "this one declares no properties");
      const Property& first = o.properties[0];
      if (!first.required) {
        return refuse(i, absl::StrCat("its first property ", first.key, " is optional"));
      }
      if (key.empty()) key = first.key;
      if (first.key != key) {
        return refuse(i, absl::StrCat("its first property is ", first.key, ", another's is ", key));
      }
      const Node& tag = grammar_.nodes[Resolve(first.value)];
      if (tag.kind != NodeKind::kLiterals) {
        return refuse(i, absl::StrCat("its first property ", key, " is not a const or an enum"));
      }
      for (const std::string& literal : tag.literals) {
        auto [it, fresh] = owner.emplace(literal, i);
        if (!fresh) {
          if (it->second == i) continue;
          return refuse(i, absl::StrCat("the value ", literal, " of ", key,
                                        " also selects alternative ", it->second));
        }
        values.literals.push_back(literal);
        sw.cases.push_back(object);
      }
      sw.alternatives.push_back(object);
    }
    sw.properties.push_back(Property{key, Add(std::move(values)), true});
    // The switch takes the first object's place; the other objects leave the union.
    const int32_t switch_node = Add(std::move(sw));
    std::vector<int32_t> kept;
    for (size_t i = 0; i < alternatives.size(); ++i) {
      if (i == objects[0]) {
        kept.push_back(switch_node);
      } else if (std::find(objects.begin(), objects.end(), i) == objects.end()) {
        kept.push_back(alternatives[i]);
      }
    }
    alternatives = std::move(kept);
    return absl::OkStatus();
  }

  static size_t CountIgnored(const Json& s) {
    size_t n = 0;
    for (const auto& [key, value] : s.items()) n += IgnoredKeywords().count(key);
    return n;
  }

  absl::StatusOr<int32_t> CompileRef(const Json& ref, const std::string& path, int depth) {
    if (!ref.is_string()) return Error(path, "must be a string");
    const std::string target = ref.get<std::string>();
    if (auto it = refs_.find(target); it != refs_.end()) return it->second;
    const Json* node = nullptr;
    if (target == "#") {
      node = &root_;
    } else {
      for (const char* prefix : {"#/$defs/", "#/definitions/"}) {
        const std::string p(prefix);
        if (target.rfind(p, 0) != 0) continue;
        const std::string section = p.substr(2, p.size() - 3);
        const std::string name = target.substr(p.size());
        auto defs = root_.find(section);
        if (defs != root_.end() && defs->is_object()) {
          if (auto def = defs->find(name); def != defs->end()) node = &*def;
        }
      }
      if (node == nullptr) {
        return Error(path, absl::StrCat("\"", target,
                                        "\" does not name a schema of this document (local "
                                        "references to #, #/$defs/... or #/definitions/...)"));
      }
    }
    // Reserved before compiling, so that a recursive reference finds it.
    const int32_t slot = Add(Node(NodeKind::kUnion));
    refs_[target] = slot;
    absl::StatusOr<int32_t> compiled =
        CompileNode(*node, absl::StrCat("schema(", target, ")"), depth + 1);
    if (!compiled.ok()) return compiled.status();
    if (*compiled == slot) return Error(path, absl::StrCat("\"", target, "\" refers to itself"));
    // The slot becomes a one-alternative union: the matcher passes through it at no cost.
    grammar_.nodes[slot].alternatives = {*compiled};
    return slot;
  }

  absl::StatusOr<int32_t> CompileTyped(const Json& s, const std::string& type,
                                       const std::string& path, int depth) {
    if (type == "object") return CompileObject(s, path, depth);
    if (type == "array") {
      Node a(NodeKind::kArray);
      if (auto items = s.find("items"); items != s.end()) {
        absl::StatusOr<int32_t> it = CompileNode(*items, path + ".items", depth + 1);
        if (!it.ok()) return it.status();
        a.items = *it;
      } else {
        a.items = AddAnyValue(grammar_);
      }
      absl::StatusOr<int32_t> lo = Count(s, "minItems", path, 0);
      absl::StatusOr<int32_t> hi = Count(s, "maxItems", path, -1);
      if (!lo.ok()) return lo.status();
      if (!hi.ok()) return hi.status();
      if (*hi >= 0 && *hi < *lo) return Error(path + ".maxItems", "is below minItems");
      a.min_items = *lo;
      a.max_items = *hi;
      return Add(std::move(a));
    }
    if (type == "string") {
      Node str(NodeKind::kString);
      absl::StatusOr<int32_t> lo = Count(s, "minLength", path, 0);
      absl::StatusOr<int32_t> hi = Count(s, "maxLength", path, -1);
      if (!lo.ok()) return lo.status();
      if (!hi.ok()) return hi.status();
      if (*hi >= 0 && *hi < *lo) return Error(path + ".maxLength", "is below minLength");
      str.min_length = *lo;
      str.max_length = *hi;
      // A pattern; else a known format as one (a pattern beside a format wins: both at once
      // would need the automata's intersection).
      std::string regex, at;
      if (auto pattern = s.find("pattern"); pattern != s.end()) {
        at = path + ".pattern";
        if (!pattern->is_string()) return Error(at, "must be a string");
        regex = pattern->get<std::string>();
      } else if (auto format = s.find("format"); format != s.end() && format->is_string()) {
        at = path + ".format";
        regex = FormatPattern(format->get<std::string>());
      }
      if (!regex.empty()) {
        // A minLength folds into the automaton. A maxLength stays a count that the matcher
        // checks against each state's distance to a match, so that a long string keeps few
        // distinct states (and its masks cached).
        absl::StatusOr<int32_t> index = AddPattern(regex, str.min_length, -1, at);
        if (!index.ok()) return index.status();
        str.regex = *index;
        str.min_length = 0;
        if (str.max_length >= 0 && grammar_.regexes[*index].DistanceToMatch(0) > str.max_length) {
          return Error(at, "no text within minLength / maxLength matches the pattern");
        }
      }
      return Add(std::move(str));
    }
    if (type == "number" || type == "integer") {
      Node number(type == "number" ? NodeKind::kNumber : NodeKind::kInteger);
      if (absl::Status st = ReadBounds(s, path, number); !st.ok()) return st;
      return Add(std::move(number));
    }
    if (type == "boolean") {
      return Add(LiteralsNode({"true", "false"}));
    }
    if (type == "null") return Add(LiteralsNode({"null"}));
    return Error(path + ".type", absl::StrCat("unknown type \"", type, "\""));
  }

  // The automaton of a string pattern with its lengths folded in (so that no character is taken
  // that the pattern could only complete past maxLength, or not at all at minLength); one per
  // distinct pattern and lengths, all of a schema's within one budget.
  absl::StatusOr<int32_t> AddPattern(const std::string& regex, int32_t min_length,
                                     int32_t max_length, const std::string& at) {
    const auto key = std::make_tuple(regex, min_length, max_length);
    if (auto it = patterns_.find(key); it != patterns_.end()) return it->second;
    absl::StatusOr<RegexDfa> dfa = CompileRegex(regex, RegexMode::kSearch);
    if (dfa.ok() && (min_length > 0 || max_length >= 0)) {
      dfa = dfa->WithLength(min_length, max_length);
    }
    if (!dfa.ok()) return Error(at, std::string(dfa.status().message()));
    pattern_entries_ += dfa->table_size();
    if (pattern_entries_ > kMaxPatternEntries) {
      return Error(at, "the schema's patterns together are too large");
    }
    const auto index = static_cast<int32_t>(grammar_.regexes.size());
    grammar_.regexes.push_back(*std::move(dfa));
    patterns_.emplace(key, index);
    return index;
  }

  // minimum / maximum / exclusiveMinimum / exclusiveMaximum (numbers; or draft 4's booleans
  // that make minimum / maximum exclusive) as bounds on the grid of 10^-scale_digits the number
  // is generated on: a bound between grid points becomes the nearest grid point inside it.
  static absl::Status ReadBounds(const Json& s, const std::string& path, Node& number) {
    number.scale_digits = number.kind == NodeKind::kInteger ? 0 : kBoundedFractionDigits;
    const int64_t unit = number.kind == NodeKind::kInteger ? 1 : 1000000;
    static_assert(kBoundedFractionDigits == 6);
    const int64_t limit = 1000000000000000000 / unit;  // |bound| in the value's own units
    auto read = [&](const char* key, bool lower, bool exclusive) -> absl::Status {
      auto it = s.find(key);
      if (it == s.end() || it->is_boolean()) return absl::OkStatus();
      const std::string at = absl::StrCat(path, ".", key);
      if (!it->is_number()) return Error(at, "must be a number");
      int64_t scaled = 0;
      if (it->is_number_integer()) {
        const int64_t x =
            it->is_number_unsigned()
                ? static_cast<int64_t>(std::min<uint64_t>(it->get<uint64_t>(), uint64_t{1} << 62))
                : it->get<int64_t>();
        if (x >= limit || x <= -limit) {
          return Error(at, absl::StrCat("must lie strictly within -", limit, " .. ", limit));
        }
        scaled = x * unit + (exclusive ? (lower ? 1 : -1) : 0);
      } else {
        const double x = it->get<double>();
        // (A bound of the limit itself would need more digits than a tracked value keeps.)
        if (!(std::fabs(x) < static_cast<double>(limit))) {
          return Error(at, absl::StrCat("must lie strictly within -", limit, " .. ", limit));
        }
        const double y = x * static_cast<double>(unit);
        const double r = std::nearbyint(y);
        // A bound that is a grid value as a double (0.1 is) compares equal to that value's
        // text as a client parses it.
        const bool on_grid = r / static_cast<double>(unit) == x;
        const double v = on_grid ? r + (exclusive ? (lower ? 1 : -1) : 0)
                                 : (lower ? std::ceil(y) : std::floor(y));
        scaled = static_cast<int64_t>(v);
      }
      // An exclusive bound at the edge moves past it: no value there is writable either.
      if (scaled >= limit * unit || scaled <= -limit * unit) {
        return Error(at, absl::StrCat("must lie strictly within -", limit, " .. ", limit));
      }
      if (lower) {
        number.min_scaled = number.has_min ? std::max(number.min_scaled, scaled) : scaled;
        number.has_min = true;
      } else {
        number.max_scaled = number.has_max ? std::min(number.max_scaled, scaled) : scaled;
        number.has_max = true;
      }
      return absl::OkStatus();
    };
    auto draft4_exclusive = [&s](const char* key) {
      auto it = s.find(key);
      return it != s.end() && it->is_boolean() && it->get<bool>();
    };
    for (const absl::Status& st : {read("minimum", true, draft4_exclusive("exclusiveMinimum")),
                                   read("exclusiveMinimum", true, true),
                                   read("maximum", false, draft4_exclusive("exclusiveMaximum")),
                                   read("exclusiveMaximum", false, true)}) {
      if (!st.ok()) return st;
    }
    if (number.has_min && number.has_max && number.min_scaled > number.max_scaled) {
      return Error(path, absl::StrCat("its bounds leave no ",
                                      number.kind == NodeKind::kInteger ? "integer" : "number",
                                      " (with up to ", number.scale_digits,
                                      " digits after the point) between them"));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<int32_t> Count(const Json& s, const char* key, const std::string& path,
                                int32_t fallback) {
    auto it = s.find(key);
    if (it == s.end()) return fallback;
    if (!it->is_number_integer() || it->get<int64_t>() < 0 || it->get<int64_t>() > (1 << 20)) {
      return Error(absl::StrCat(path, ".", key), "must be an integer in [0, 1048576]");
    }
    return static_cast<int32_t>(it->get<int64_t>());
  }

  absl::StatusOr<int32_t> CompileObject(const Json& s, const std::string& path, int depth) {
    Node o(NodeKind::kObject);
    std::set<std::string> required;
    if (auto r = s.find("required"); r != s.end()) {
      if (!r->is_array()) return Error(path + ".required", "must be an array of names");
      for (const Json& name : *r) {
        if (!name.is_string()) return Error(path + ".required", "must be an array of names");
        required.insert(name.get<std::string>());
      }
    }
    auto props = s.find("properties");
    if (props != s.end()) {
      if (!props->is_object()) return Error(path + ".properties", "must be an object");
      // In the text's order (ordered_json): declared properties are generated in it.
      for (const auto& [name, sub] : props->items()) {
        absl::StatusOr<int32_t> value =
            CompileNode(sub, absl::StrCat(path, ".properties.", name), depth + 1);
        if (!value.ok()) return value.status();
        o.properties.push_back(Property{QuotedJson(name), *value, required.count(name) > 0});
      }
    }
    for (const std::string& name : required) {
      bool found = false;
      for (const Property& p : o.properties) found |= p.key == QuotedJson(name);
      if (!found) {
        return Error(path + ".required",
                     absl::StrCat("\"", name, "\" is required but not among the properties"));
      }
    }
    if (o.properties.empty()) {
      auto extra = s.find("additionalProperties");
      if (extra == s.end() || (extra->is_boolean() && extra->get<bool>())) {
        o.additional = AddAnyValue(grammar_);
      } else if (extra->is_boolean()) {
        o.additional = -1;  // only {}
      } else {
        absl::StatusOr<int32_t> value =
            CompileNode(*extra, path + ".additionalProperties", depth + 1);
        if (!value.ok()) return value.status();
        o.additional = *value;
      }
    }
    return Add(std::move(o));
  }

  // The transition-table entries all of a schema's patterns may hold (32 MB).
  static constexpr size_t kMaxPatternEntries = size_t{1} << 23;

  const Json& root_;
  Grammar grammar_;
  std::map<std::string, int32_t> refs_;
  std::map<std::tuple<std::string, int32_t, int32_t>, int32_t> patterns_;
  size_t pattern_entries_ = 0;
};

}  // namespace

absl::StatusOr<Grammar> CompileJsonSchema(const nlohmann::ordered_json& schema) {
  return SchemaCompiler(schema).Compile();
}

absl::StatusOr<Grammar> CompileJsonSchemaText(std::string_view text) {
  absl::StatusOr<nlohmann::ordered_json> schema =
      ParseOrderedJson(absl::string_view(text.data(), text.size()));
  if (!schema.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the schema is not valid JSON: ", schema.status().message()));
  }
  return CompileJsonSchema(*schema);
}

int32_t AddAnyValue(Grammar& g) {
  if (g.any_value >= 0) return g.any_value;
  const int32_t any = AddNode(g, Node(NodeKind::kUnion));
  g.any_value = any;
  const int32_t object = AddNode(g, ObjectOf(any));
  const int32_t array = AddNode(g, ArrayOf(any));
  const int32_t string = AddNode(g, Node(NodeKind::kString));
  const int32_t number = AddNode(g, Node(NodeKind::kNumber));
  const int32_t literal = AddNode(g, LiteralsNode({"true", "false", "null"}));
  g.nodes[any].alternatives = {object, array, string, number, literal};
  return any;
}

Grammar JsonObjectGrammar() {
  Grammar g;
  g.string_node = AddNode(g, Node(NodeKind::kString));
  g.root = AddNode(g, ObjectOf(AddAnyValue(g)));
  (void)FinishGrammar(g);  // its one union, any value, starts differently: cannot fail
  return g;
}

namespace {

// The grammar's root becomes `before`, the old root, then `after`, in sequence.
absl::Status WrapRoot(Grammar& g, int32_t before, int32_t after = -1) {
  Node sequence(NodeKind::kSequence);
  sequence.alternatives = {before, g.root};
  if (after >= 0) sequence.alternatives.push_back(after);
  g.root = AddNode(g, std::move(sequence));
  return FinishGrammar(g);
}

}  // namespace

absl::StatusOr<Grammar> TaggedJsonGrammar(const std::string& begin, std::string_view schema,
                                          const std::string& end, int32_t max_blocks,
                                          const std::string& separator) {
  if (begin.empty() || end.empty()) {
    return absl::InvalidArgumentError("the texts around a tagged value must not be empty");
  }
  if (max_blocks == 0 || max_blocks < -1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_blocks must be -1 (no limit) or at least 1, got ", max_blocks));
  }
  if (max_blocks != 1 && separator.empty()) {
    return absl::InvalidArgumentError("several tagged values need a separator");
  }
  absl::StatusOr<Grammar> g = CompileJsonSchemaText(schema);
  if (!g.ok()) return g.status();
  const int32_t open = AddNode(*g, LiteralsNode({begin}));
  if (absl::Status s = WrapRoot(*g, open, AddNode(*g, LiteralsNode({end}))); !s.ok()) return s;
  if (max_blocks == 1) return g;
  Node repeat(NodeKind::kRepeat);
  repeat.items = g->root;
  repeat.min_items = 1;
  repeat.max_items = max_blocks;
  repeat.literals = {separator};
  g->root = AddNode(*g, std::move(repeat));
  if (absl::Status s = FinishGrammar(*g); !s.ok()) return s;
  return g;
}

absl::Status AddReasoningBlock(Grammar& g, const std::string& end) {
  if (end.empty()) return absl::InvalidArgumentError("the reasoning block's end marker is empty");
  Node until(NodeKind::kUntil);
  until.literals = {end};
  return WrapRoot(g, AddNode(g, std::move(until)));
}

absl::StatusOr<Grammar> RegexGrammar(std::string_view pattern) {
  absl::StatusOr<RegexDfa> dfa = CompileRegex(pattern, RegexMode::kWhole);
  if (!dfa.ok()) return dfa.status();
  if (!dfa->AnyNext(dfa->start(), 0, kMaxCodePoint)) {
    return absl::InvalidArgumentError(
        "it matches only the empty text, and the output needs at least one character");
  }
  Grammar g;
  g.string_node = AddNode(g, Node(NodeKind::kString));
  Node text(NodeKind::kRegex);
  text.regex = 0;
  g.regexes.push_back(*std::move(dfa));
  g.root = AddNode(g, std::move(text));
  if (absl::Status s = FinishGrammar(g); !s.ok()) return s;
  return g;
}

absl::StatusOr<Grammar> ChoiceGrammar(const std::vector<std::string>& choices) {
  if (choices.empty()) return absl::InvalidArgumentError("the list of choices is empty");
  for (size_t i = 0; i < choices.size(); ++i) {
    if (choices[i].empty()) {
      return absl::InvalidArgumentError(absl::StrCat("choice ", i, " is empty"));
    }
  }
  Grammar g;
  g.string_node = AddNode(g, Node(NodeKind::kString));
  g.root = AddNode(g, LiteralsNode(choices));
  if (absl::Status s = FinishGrammar(g); !s.ok()) return s;
  return g;
}

}  // namespace mobius::grammar
