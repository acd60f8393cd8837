#include "cli/train_field_flags.h"

#include <fmt/format.h>

#include <algorithm>

#include "meshtrain/core/error.h"

namespace meshtrain::cli {

namespace {

const train::TrainField& field_of(std::string_view key) {
  const auto fields = train::train_config_fields();
  const auto it = std::find_if(fields.begin(), fields.end(), [&](const train::TrainField& f) { return f.key == key; });
  if (it == fields.end()) throw InvalidArgument("TrainFieldFlags", fmt::format("no train field '{}'", key));
  return *it;
}

}  // namespace

TrainFieldFlags::TrainFieldFlags(CLI::App* app, std::span<const std::string_view> keys) : app_(app) {
  const train::TrainConfig defaults;
  for (std::string_view key : keys) {
    const train::TrainField& field = field_of(key);
    const std::string shown = field.format(defaults);
    CLI::Option* o = app->add_option(std::string(field.flag), values_[std::string(key)],
                                     fmt::format("{} (default {})", field.help, shown.empty() ? "\"\"" : shown));
    if (field.kind == train::TrainFieldKind::boolean) o->expected(0, 1);
  }
}

void TrainFieldFlags::apply(train::TrainConfig& tc) const {
  for (const auto& [key, text] : values_) {
    const train::TrainField& field = field_of(key);
    if (app_->get_option(std::string(field.flag))->count() == 0) continue;
    tc.set(field.key, text.empty() && field.kind == train::TrainFieldKind::boolean ? "true" : text, field.flag);
  }
}

}  // namespace meshtrain::cli
