-- ack_and_drop(ids_by_lane, group): acknowledge and delete, in `group`, the entry ids listed per
-- lane (ids_by_lane[1] online, ids_by_lane[2] bulk).
--
-- KEYS[3]: the calling script's online stream
-- KEYS[4]: the calling script's bulk stream
-- ARGV: none of its own; `group` is the calling script's consumer group argument.
local function ack_and_drop(ids_by_lane, group)
  for lane = 1, 2 do
    if #ids_by_lane[lane] > 0 then
      redis.call('XACK', KEYS[lane + 2], group, unpack(ids_by_lane[lane]))
      redis.call('XDEL', KEYS[lane + 2], unpack(ids_by_lane[lane]))
    end
  end
end
