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
           {R"({"type": "string", "pattern": "^a"})",
            "schema.pattern: this keyword is not supported"},
           {R"({"properties": {"age": {"type": "integer", "minimum": 0}}})",
            "schema.properties.age.minimum: this keyword is not supported"},
           {R"({"type": "strange"})", "schema.type: unknown type \"strange\""},
           {R"({"anyOf": [{"type": "string"}, {"enum": ["a"]}]})", "start differently"},
           {R"({"type": "integer", "oneOf": [{"type": "integer"}, {"type": "number"}]})",
            "start differently"},
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
