// Reading one series out of a Prometheus text scrape (metrics::Registry::RenderText, or a real
// proximad's GET /metrics), for tests. Header-only; needs absl strings.
#ifndef PROXIMA_COMMON_TESTING_METRIC_VALUE_H_
#define PROXIMA_COMMON_TESTING_METRIC_VALUE_H_

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace proxima::testing {

// The value of `series` (name plus labels, exactly as exported) in `text`, or -1 when absent.
inline double MetricValue(absl::string_view text, absl::string_view series) {
  const std::string prefix = absl::StrCat(series, " ");
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (absl::StartsWith(line, prefix)) {
      double v = 0;
      if (absl::SimpleAtod(line.substr(prefix.size()), &v)) return v;
    }
  }
  return -1;
}

}  // namespace proxima::testing

#endif  // PROXIMA_COMMON_TESTING_METRIC_VALUE_H_
