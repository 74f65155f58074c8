#include "grammar/json_schema_compiler.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace mobius::grammar {
namespace {

using ::testing::HasSubstr;

TEST(JsonSchemaCompilerTest, RefusesWhatItCannotEnforceByName) {
  struct Case {
    std::string schema;
    std::string message;
  };
  for (const Case& c : std::vector<Case>{
           {R"({"type": "string", "pattern": "\\bx"})",
            "schema.pattern: word boundaries (\\b) are not supported (at offset 0)"},
           {R"({"type": "string", "pattern": "^(ab)+$", "minLength": 3, "maxLength": 3})",
            "schema.pattern: no text within minLength / maxLength matches the pattern"},
           {R"({"properties": {"age": {"type": "integer", "multipleOf": 2}}})",
            "schema.properties.age.multipleOf: this keyword is not supported"},
           {R"({"type": "integer", "minimum": 3, "maximum": 2})",
            "schema: its bounds leave no integer"},
           {R"({"type": "integer", "minimum": 0.2, "maximum": 0.8})",
            "schema: its bounds leave no integer"},
           {R"({"type": "number", "exclusiveMinimum": 1, "exclusiveMaximum": 1.0000001})",
            "schema: its bounds leave no number (with up to 6 digits after the point)"},
           {R"({"type": "number", "maximum": 1e13})",
            "schema.maximum: must lie strictly within -1000000000000 .. 1000000000000"},
           {R"({"type": "integer", "minimum": 1000000000000000000})",
            "schema.minimum: must lie strictly within"},
           {R"({"type": "number", "minimum": 1e12})", "schema.minimum: must lie strictly within"},
           {R"({"type": "integer", "exclusiveMinimum": 999999999999999999})",
            "schema.exclusiveMinimum: must lie strictly within"},
           {R"({"type": "integer", "minimum": "0"})", "schema.minimum: must be a number"},
           {R"({"type": "strange"})", "schema.type: unknown type \"strange\""},
           {R"({"anyOf": [{"type": "string"}, {"enum": ["a"]}]})", "start differently"},
           {R"({"oneOf": [{"type": "integer"}, {"type": "number"}]})", "start differently"},
           {R"({"$ref": "#/$defs/missing"})", "does not name a schema of this document"},
           {R"({"$ref": "https://example.com/s.json"})", "does not name a schema"},
           {R"({"properties": {"a": {}}, "required": ["b"]})",
            "\"b\" is required but not among the properties"},
           {R"({"type": "array", "minItems": 3, "maxItems": 2})", "maxItems: is below minItems"},
           {R"({"type": "string", "maxLength": -1})", "maxLength: must be an integer"},
           {R"(false)", "admits no value"},
           {R"({"allOf": [{"type": "string"}, {"maxLength": 3}]})", "only an allOf of one"},
           {R"({"$ref": "#"})", "refers to itself"},
           {R"({"type": "object")", "not valid JSON"},
       }) {
    absl::StatusOr<Grammar> g = CompileJsonSchemaText(c.schema);
    ASSERT_FALSE(g.ok()) << c.schema;
    EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(g.status().message()), HasSubstr(c.message)) << c.schema;
  }
}

TEST(JsonSchemaCompilerTest, RefusesWhatTheMatcherCouldNotFinish) {
  struct Case {
    std::string schema;
    std::string message;
  };
  // 28 nested required objects: deeper than the matcher keeps (within the parser's 64 levels).
  std::string deep = R"({"type": "string"})";
  for (int i = 0; i < 28; ++i) {
    deep = R"({"type": "object", "properties": {"a": )" + deep + R"(}, "required": ["a"]})";
  }
  // A chain of 31 unions of two equal references (2^31 paths): refused at once.
  std::string chain = R"({"$ref": "#/$defs/d0", "$defs": {)";
  for (int i = 0; i < 31; ++i) {
    chain += "\"d" + std::to_string(i) + R"(": {"anyOf": [{"$ref": "#/$defs/d)" +
             std::to_string(i + 1) + R"("}, {"$ref": "#/$defs/d)" + std::to_string(i + 1) +
             R"("}]}, )";
  }
  chain += R"("d31": {"type": "string"}}})";
  for (const Case& c : std::vector<Case>{
           {deep, "nest deeper than"},
           {chain, "start differently"},
           {R"({"$defs": {"x": {"anyOf": [{"$ref": "#/$defs/x"}, {"type": "string"}]}},
               "$ref": "#/$defs/x"})",
            "start differently"},
           {R"({"anyOf": [{"type": "string"}, {"type": "null"}], "maxLength": 3})",
            "schema.maxLength: keywords beside anyOf are not supported"},
           {R"({"type": "string", "enum": [1, 2]})", "schema.enum: no value has the schema's type"},
           {R"({"enum": ["a"], "maxLength": 3})", "schema.maxLength: keywords beside enum"},
       }) {
    absl::StatusOr<Grammar> g = CompileJsonSchemaText(c.schema);
    ASSERT_FALSE(g.ok()) << c.schema;
    EXPECT_THAT(std::string(g.status().message()), HasSubstr(c.message)) << c.schema;
  }
  // enum beside type keeps the values of that type.
  absl::StatusOr<Grammar> typed = CompileJsonSchemaText(R"({"type": "string", "enum": ["a", 1]})");
  ASSERT_TRUE(typed.ok()) << typed.status();
  EXPECT_EQ(typed->nodes[typed->root].literals, std::vector<std::string>{"\"a\""});
}

TEST(JsonSchemaCompilerTest, ObjectAlternativesNeedADiscriminatorFirst) {
  struct Case {
    std::string schema;
    std::string message;
  };
  const std::string circle =
      R"({"type": "object", "properties": {"k": {"const": "c"}}, "required": ["k"]})";
  for (const Case& c : std::vector<Case>{
           {R"({"anyOf": [)" + circle + R"(, {"type": "object"}]})",
            "schema.anyOf[1]: objects among the alternatives must share a required first "
            "property whose const or enum values tell them apart (such as \"type\"): this one "
            "declares no properties"},
           {R"({"anyOf": [)" + circle + R"(, {"properties": {"k": {"const": "d"}}}]})",
            "schema.anyOf[1]: objects among the alternatives must share a required first "
            "property whose const or enum values tell them apart (such as \"type\"): its first "
            "property \"k\" is optional"},
           {R"({"oneOf": [)" + circle +
                R"(, {"properties": {"j": {"const": "d"}}, "required": ["j"]}]})",
            "its first property is \"j\", another's is \"k\""},
           {R"({"anyOf": [)" + circle +
                R"(, {"properties": {"k": {"type": "string"}}, "required": ["k"]}]})",
            "schema.anyOf[1]: objects among the alternatives must share a required first "
            "property whose const or enum values tell them apart (such as \"type\"): its first "
            "property \"k\" is not a const or an enum"},
           {R"({"anyOf": [)" + circle +
                R"(, {"properties": {"k": {"enum": ["d", "c"]}}, "required": ["k"]}]})",
            "the value \"c\" of \"k\" also selects alternative 0"},
       }) {
    absl::StatusOr<Grammar> g = CompileJsonSchemaText(c.schema);
    ASSERT_FALSE(g.ok()) << c.schema;
    EXPECT_THAT(std::string(g.status().message()), HasSubstr(c.message)) << c.schema;
  }
}

TEST(JsonSchemaCompilerTest, IgnoresAnnotationsAndCompilesPydanticOutput) {
  // What pydantic's model_json_schema() gives for a model with a nested model, an optional
  // field and a literal.
  absl::StatusOr<Grammar> g = CompileJsonSchemaText(R"({
    "$defs": {"Address": {"properties": {"city": {"title": "City", "type": "string"}},
                          "required": ["city"], "title": "Address", "type": "object"}},
    "properties": {
      "name": {"title": "Name", "type": "string", "description": "full name"},
      "age": {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": null},
      "home": {"$ref": "#/$defs/Address"},
      "mode": {"enum": ["a", "b"], "title": "Mode", "type": "string"},
      "when": {"format": "date-time", "type": "string"}},
    "required": ["name", "home"], "title": "Person", "type": "object"})");
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_GE(g->root, 0);
  EXPECT_EQ(g->first_bytes.size(), g->nodes.size());
}

TEST(JsonSchemaCompilerTest, EmptyAndTrueSchemasAreAnyValue) {
  for (const char* s : {"{}", "true", R"({"title": "x"})"}) {
    absl::StatusOr<Grammar> g = CompileJsonSchemaText(s);
    ASSERT_TRUE(g.ok()) << s;
    EXPECT_EQ(g->root, g->any_value) << s;
  }
}

}  // namespace
}  // namespace mobius::grammar
