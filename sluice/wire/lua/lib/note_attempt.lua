-- note_attempt(job, err, at): append one ended attempt's error (a table: code, message) and when it
-- ended to the job's `attempt_errors`, a JSON list (`sluice.wire.jobs.JobRecord.attempt_errors`).
-- noted_attempts(job): how many attempts' errors the job holds.
--
-- KEYS: none of its own; `job` is a job hash the calling script was given.
-- ARGV: none of its own.
--
-- An attempt that ends in a final state is not noted: its error is the job's `error`.
local function noted(job)
  local raw = redis.call('HGET', job, 'attempt_errors')
  if raw then return cjson.decode(raw) end
  return {}
end
local function note_attempt(job, err, at)
  local list = noted(job)
  list[#list + 1] = {error = err, at = tonumber(at)}
  redis.call('HSET', job, 'attempt_errors', cjson.encode(list))
end
local function noted_attempts(job)
  return #noted(job)
end
