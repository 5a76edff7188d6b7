// The one-family shorthand of KVArgs and its state_families list, as one list
// (EffectiveStateFamilies, include/pdlib/kv_args.h). In lib/base so that the planner, the cores
// and the Python binding read KVArgs' state the same way.
#include <utility>
#include <vector>

#include "pdlib/kv_args.h"

namespace pdlib {
inline namespace v1 {

StatusOr<std::vector<StateFamily>> EffectiveStateFamilies(const KVArgs& args) {
  const bool shorthand = args.state_type != StateType::kNone || !args.state.empty() ||
                         !args.state_dim_per_tensor.empty() || !args.state_item_rows.empty() ||
                         !args.state_split_units.empty() || args.state_start != 0;
  if (!args.state_families.empty()) {
    if (shorthand) {
      return Status::InvalidArgument(
          "state given twice: state_families and the one-family fields (state_type, state, "
          "state_dim_per_tensor, state_item_rows, state_split_units, state_start); use one");
    }
    return args.state_families;
  }
  if (!shorthand) return std::vector<StateFamily>{};
  if (args.state_type == StateType::kNone) {
    return Status::InvalidArgument("state buffers given but state_type is none");
  }
  StateFamily f;
  f.type = args.state_type;
  f.buffers = args.state;
  f.dim_per_tensor = args.state_dim_per_tensor;
  f.item_rows = args.state_item_rows;
  f.split_units = args.state_split_units;
  f.start = args.state_start;
  return std::vector<StateFamily>{std::move(f)};
}

}  // namespace v1
}  // namespace pdlib
